"""sgl_kernel.kvcacheio stand-in: the published signatures, every call raises."""

from sgl_kernel import UnavailableOp


def _unavailable(name):
    raise UnavailableOp(f"sgl_kernel.kvcacheio.{name}")()


def transfer_kv_per_layer(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size, block_quota=2,
                          num_warps_per_block=32):
    _unavailable("transfer_kv_per_layer")


def transfer_kv_per_layer_pf_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size,
                                src_layout_dim, block_quota=2, num_warps_per_block=32):
    _unavailable("transfer_kv_per_layer_pf_lf")


def transfer_kv_per_layer_ph_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size,
                                src_layout_dim, page_size, head_num, block_quota=2, num_warps_per_block=32):
    _unavailable("transfer_kv_per_layer_ph_lf")


def transfer_kv_all_layer(src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, src_indices, dst_indices,
                          item_size, num_layers, block_quota=2, num_warps_per_block=32):
    _unavailable("transfer_kv_all_layer")


def transfer_kv_all_layer_lf_pf(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size,
                                dst_layout_dim, num_layers, block_quota=2, num_warps_per_block=32):
    _unavailable("transfer_kv_all_layer_lf_pf")


def transfer_kv_all_layer_lf_ph(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size,
                                dst_layout_dim, num_layers, page_size, head_num, block_quota=2,
                                num_warps_per_block=32):
    _unavailable("transfer_kv_all_layer_lf_ph")


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    _unavailable("transfer_kv_direct")


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    _unavailable("transfer_kv_per_layer_direct_pf_lf")


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    _unavailable("transfer_kv_all_layer_direct_lf_pf")


def transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size, block_quota=2, num_warps_per_block=32):
    _unavailable("transfer_kv_per_layer_mla")


def transfer_kv_per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim,
                                    block_quota=2, num_warps_per_block=32):
    _unavailable("transfer_kv_per_layer_mla_pf_lf")


def transfer_kv_all_layer_mla(src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers,
                              block_quota=2, num_warps_per_block=32):
    _unavailable("transfer_kv_all_layer_mla")


def transfer_kv_all_layer_mla_lf_pf(src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim,
                                    num_layers, block_quota=2, num_warps_per_block=32):
    _unavailable("transfer_kv_all_layer_mla_lf_pf")


def get_device_accessible_ptr(tensor, device_index):
    _unavailable("get_device_accessible_ptr")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return UnavailableOp(f"sgl_kernel.kvcacheio.{name}")
