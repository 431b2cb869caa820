// Thin PyTorch binding for the torch-free launcher in hicache_transfer.cu.
//
// Written against PyTorch's stable C ABI (torch/csrc/stable): those headers
// compile in about half a second, where torch/library.h with ATen takes four.
// Python (sglang_hicache_jit/ops.py) validates every argument and computes
// the addresses; this layer only picks the device and stream and launches.
//
// The op namespace is TORCH_EXTENSION_NAME, which the loader makes unique per
// build, so two builds (say for different archs) can live in one process.

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <string>

#include "hicache_transfer.h"

namespace {

using torch::stable::Tensor;

// Returns the method that ran (HICACHE_METHOD_PLAIN or HICACHE_METHOD_BULK).
int64_t transfer(Tensor indices_src, Tensor indices_dst, int64_t src_base0, int64_t src_base1,
                 int64_t dst_base0, int64_t dst_base1, int64_t src_table0, int64_t src_table1,
                 int64_t dst_table0, int64_t dst_table1, int64_t num_caches, int64_t num_layers,
                 int64_t src_stride, int64_t dst_stride, int64_t row_bytes, int64_t src_rows,
                 int64_t dst_rows, int64_t num_blocks, int64_t method, int64_t bulk_warps,
                 int64_t read_align, int64_t error_flags) {
  STD_TORCH_CHECK(indices_src.is_cuda() && indices_dst.is_cuda(), "indices must be CUDA tensors");
  STD_TORCH_CHECK(indices_src.numel() == indices_dst.numel(), "index lengths differ");
  const auto device = indices_src.get_device_index();

  HicacheTransfer t{};
  t.src_tables[0] = reinterpret_cast<const uint64_t*>(src_table0);
  t.src_tables[1] = reinterpret_cast<const uint64_t*>(src_table1);
  t.dst_tables[0] = reinterpret_cast<const uint64_t*>(dst_table0);
  t.dst_tables[1] = reinterpret_cast<const uint64_t*>(dst_table1);
  t.src_bases[0] = static_cast<uint64_t>(src_base0);
  t.src_bases[1] = static_cast<uint64_t>(src_base1);
  t.dst_bases[0] = static_cast<uint64_t>(dst_base0);
  t.dst_bases[1] = static_cast<uint64_t>(dst_base1);
  t.num_caches = static_cast<int32_t>(num_caches);
  t.num_layers = static_cast<int32_t>(num_layers);
  t.indices_src = indices_src.data_ptr();
  t.indices_dst = indices_dst.data_ptr();
  t.index_bytes = static_cast<int32_t>(indices_src.element_size());
  STD_TORCH_CHECK(indices_dst.element_size() == indices_src.element_size(), "index dtypes differ");
  t.num_items = indices_src.numel();
  t.src_stride = src_stride;
  t.dst_stride = dst_stride;
  t.row_bytes = row_bytes;
  t.src_rows = src_rows;
  t.dst_rows = dst_rows;
  t.num_blocks = static_cast<int32_t>(num_blocks);
  t.bulk_warps = static_cast<int32_t>(bulk_warps);
  t.read_align = static_cast<int32_t>(read_align);
  t.error_flags = reinterpret_cast<uint32_t*>(error_flags);

  t.method = static_cast<int32_t>(method);

  torch::stable::accelerator::DeviceGuard guard(device);
  void* stream = nullptr;
  STD_TORCH_CHECK(aoti_torch_get_current_cuda_stream(device, &stream) == AOTI_TORCH_SUCCESS,
                  "hicache transfer: cannot read the current CUDA stream");
  int method_used = 0;
  const int err = hicache_transfer_launch(&t, stream, &method_used);
  STD_TORCH_CHECK(err == 0, "hicache transfer: ", hicache_error_string(err));
  return method_used;
}

}  // namespace

STABLE_TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def(
      "transfer(Tensor indices_src, Tensor indices_dst, int src_base0, int src_base1, "
      "int dst_base0, int dst_base1, int src_table0, int src_table1, int dst_table0, "
      "int dst_table1, int num_caches, int num_layers, int src_stride, int dst_stride, "
      "int row_bytes, int src_rows, int dst_rows, int num_blocks, int method, int bulk_warps, "
      "int read_align, int error_flags) -> int");
}

STABLE_TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CUDA, m) { m.impl("transfer", TORCH_BOX(&transfer)); }
