"""The index dtype rule (transfer/bounds.py, check_index_tensor), attacked on the CPU at the routed SGLang ops'
entry points and at the layer ids they take: integer tensors only (int32, int64), dense, holding data, on the
CPU or the transfer's GPU. Anything else is one TypeError or ValueError naming the argument, and nothing is
written; a negative index stays padding. The GPU half (the staged page_first backup, CUDA tables) is in
tests/test_pointer_tables_gpu.py.

Each destination is the middle of a larger tensor whose rows before and after are guard rows."""

import re

import pytest
import torch

import fake_gpu
from sglang_hicache_jit.integrations.sglang import ops as routed
from sglang_hicache_jit.transfer import bounds

GUARD, P, L, D, HEADS = 3, 4, 3, 8, 2


class Guarded:
    def __init__(self, rows, *row, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.whole = torch.randint(-1000, 1000, (rows + 2 * GUARD, *row), generator=gen, dtype=torch.int32)
        self.before = self.whole.clone()
        self.t = self.whole[GUARD:GUARD + rows]

    def untouched(self) -> bool:
        return torch.equal(self.whole, self.before)


def _numpy():
    np = pytest.importorskip("numpy")
    return np.array([1, 2])


# Each: (make the index, the error, what the message must say besides the argument's name).
BAD = {
    "float": (lambda: torch.tensor([1.9, 2.2]), TypeError, "int32 or int64"),
    "nan": (lambda: torch.tensor([float("nan"), 1.0]), TypeError, "int32 or int64"),
    "uint64-2^63": (lambda: torch.tensor([1 << 63, 1], dtype=torch.uint64), TypeError, "int32 or int64"),
    "bool": (lambda: torch.tensor([True, False]), TypeError, "int32 or int64"),
    "int16": (lambda: torch.tensor([1, 2], dtype=torch.int16), TypeError, "int32 or int64"),
    "meta": (lambda: torch.zeros(2, dtype=torch.int64, device="meta"), ValueError, "meta"),
    "sparse": (lambda: torch.tensor([1, 2]).to_sparse(), TypeError, "dense"),
    "list": (lambda: [1, 2], TypeError, "torch.Tensor"),
    "numpy": (_numpy, TypeError, "torch.Tensor"),
    "2-D": (lambda: torch.tensor([[1, 2]]), ValueError, "1-D"),
}


def named(text: str, argument: str) -> bool:
    return re.search(rf"\b{re.escape(argument)}\b", text) is not None


def _ph_lf(src_indices, dst_indices, layer_id=1):
    """transfer_kv_per_layer_ph_lf: page_head host pages -> device rows (the copy engines on the CPU)."""
    host = [Guarded(2, HEADS, P, L, D, seed=s) for s in (1, 2)]  # 2 pages of page_head rows
    dev = [Guarded(2 * P, HEADS, D, seed=s) for s in (3, 4)]
    routed.transfer_kv_per_layer_ph_lf(host[0].t, dev[0].t, host[1].t, dev[1].t, src_indices, dst_indices,
                                       layer_id, HEADS * D * 4, 0, P, HEADS)
    return dev


def _lf_ph(src_indices, dst_indices):
    dev = [Guarded(2 * P, HEADS, D, seed=s) for s in (5, 6)]
    host = [Guarded(2, HEADS, P, L, D, seed=s) for s in (7, 8)]
    from sglang_hicache_jit.transfer import extents

    for g in dev:
        extents.register(g.t)  # what the pointer tables below point into (the plugin registers a pool's layers)
    tables = [torch.tensor([g.t.data_ptr()] * L, dtype=torch.int64).view(torch.uint64) for g in dev]
    try:
        routed.transfer_kv_all_layer_lf_ph(tables[0], host[0].t, tables[1], host[1].t, src_indices, dst_indices,
                                           HEADS * D * 4, 0, L, P, HEADS)
    finally:
        extents.clear()
    return host


def _per_layer_mla(src_indices, dst_indices):
    dev = Guarded(2 * P, D, seed=9)
    with routed.copy_engines_only():
        routed.transfer_kv_per_layer_mla(torch.zeros(2 * P, D, dtype=torch.int32), dev.t, src_indices, dst_indices,
                                         D * 4)
    return [dev]


def _kv_direct(src_indices, dst_indices):
    dev = Guarded(2 * P, D, seed=10)
    routed.transfer_kv_direct([torch.zeros(2 * P, D, dtype=torch.int32)], [dev.t], src_indices, dst_indices, P)
    return [dev]


def _pf_lf_direct(src_indices, dst_indices):
    host = torch.zeros(2, L, P, 1, D, dtype=torch.int32)
    dev = Guarded(2 * P, 1, D, seed=11)
    routed.transfer_kv_per_layer_direct_pf_lf([host], [dev.t], src_indices, dst_indices, 1, P)
    return [dev]


ENTRIES = {  # op -> (call(src_indices, dst_indices), the host-token side's name: its indices are mapped to rows)
    "per_layer_ph_lf": (_ph_lf, "src_indices"),
    "all_layer_lf_ph": (_lf_ph, "dst_indices"),
    "per_layer_mla": (_per_layer_mla, None),
    "kv_direct": (_kv_direct, None),
    "per_layer_direct_pf_lf": (_pf_lf_direct, "src_indices"),
}


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("side", ["src_indices", "dst_indices"])
@pytest.mark.parametrize("op", ENTRIES)
def test_routed_ops_refuse_non_integer_indices_naming_them(op, side, bad):
    """Before: float host tokens were truncated ([1.9, 2.2] copied rows 1 and 2) in ph_lf, NaN and uint64
    2**63 became padding (skipped in silence), and a list, numpy array, meta or sparse tensor raised
    AttributeError or RuntimeError from inside the copy-engine path's plan cache or torch."""
    make, error, expected = BAD[bad]
    call, _ = ENTRIES[op]
    good = torch.arange(2)  # as long as the bad ones: a length mismatch must not be what refuses them
    written = []
    with pytest.raises(error) as info:
        written = call(make() if side == "src_indices" else good, make() if side == "dst_indices" else good)
    message = str(info.value)
    assert named(message, side) and expected in message and "\n" not in message, message
    assert not written


def test_the_guards_stay_untouched_when_a_float_host_token_is_refused():
    host = [Guarded(2, HEADS, P, L, D, seed=s) for s in (1, 2)]
    dev = [Guarded(2 * P, HEADS, D, seed=s) for s in (3, 4)]
    with pytest.raises(TypeError, match="src_indices must be int32 or int64, got torch.float32"):
        routed.transfer_kv_per_layer_ph_lf(host[0].t, dev[0].t, host[1].t, dev[1].t, torch.tensor([1.9, 2.2]),
                                           torch.tensor([0, 1]), 1, HEADS * D * 4, 0, P, HEADS)
    assert all(g.untouched() for g in host + dev)


def test_negative_indices_are_still_padding():
    dev = _ph_lf(torch.tensor([-1, 2, 3, -5]), torch.tensor([0, 1, -1, 3]))
    kept = dev[0].t.clone()
    assert not dev[0].untouched()  # row 1 was written (token 2 -> device row 1) ...
    expected = dev[0].before[GUARD:GUARD + 2 * P].clone()
    expected[1] = kept[1]
    assert torch.equal(kept, expected)  # ... and nothing else: the padded pairs were skipped


@pytest.mark.parametrize("layer_id", [torch.tensor(1, device="meta"), True, torch.tensor(True), 1.0,
                                      torch.tensor(1.5), "1"], ids=["meta", "bool", "bool-tensor", "float",
                                                                    "float-tensor", "str"])
def test_a_layer_id_that_is_not_an_int_is_refused_naming_it(layer_id):
    """Before: a meta layer_id raised RuntimeError (Tensor.item() cannot be called on meta tensors), and
    True was taken for layer 1."""
    with pytest.raises(TypeError, match="layer_id must be an int"):
        _ph_lf(torch.arange(P), torch.arange(P), layer_id=layer_id)
    with pytest.raises(TypeError, match="layer_id must be an int"):
        bounds.check_layer(layer_id, L)
    assert bounds.check_layer(torch.tensor(2), L) == 2  # an integer tensor is an int


def test_indices_on_another_device_are_refused_naming_them():
    with pytest.raises(ValueError, match="indices_dst is on cuda:1 but the transfer runs on cuda:0"):
        bounds.check_index_tensor("indices_dst", fake_gpu.cuda(torch.arange(2)).as_subclass(_OnCuda1), 0)


class _OnCuda1(fake_gpu.FakeCuda):
    device = torch.device("cuda", 1)


def test_the_staged_backup_refuses_non_integer_host_indices_before_staging_reads_them(monkeypatch):
    """Before: the page_first backup's staging area read the host indices with .to(int64): [1.9, 2.2] backed up
    into host rows 1 and 2 (GPU only: the staging area needs one; here a stand-in records what it gets)."""
    host = fake_gpu.pinned(torch.zeros(16, L, D, dtype=torch.int32))
    table = fake_gpu.cuda(torch.tensor([1, 2, 3], dtype=torch.int64).view(torch.uint64))
    staged = []
    area = type("Area", (), {"backup": lambda self, dst, src, **kw: staged.append((dst, src)) or True})()
    if hasattr(routed, "_kernel_works"):  # the probe says the kernel (the staging area's gather) works
        monkeypatch.setattr(routed, "_kernel_works", lambda size: True)
    else:  # where transfer/route.py decides
        monkeypatch.setattr(routed.route, "routed_stages", lambda **kwargs: True)
    monkeypatch.setattr(routed.pointer_tables, "checked", lambda t, name: type(
        "Checked", (), {"rows": lambda self, stride, row, name: 16})())
    monkeypatch.setitem(routed._stagings, (host.data_ptr(), table.data_ptr(), D * 4, L, 16),
                        (lambda: routed.compat._root(host), routed.settings.staging_bytes(), area))  # its owner
    routed.transfer_kv_all_layer_mla_lf_pf(table, host, torch.arange(2), torch.arange(2), D * 4, L * D * 4, L)
    assert len(staged) == 1  # the stand-in serves a good call
    for bad in ("float", "nan", "uint64-2^63", "list"):
        make, error, _ = BAD[bad]
        with pytest.raises(error, match="dst_indices"):
            routed.transfer_kv_all_layer_mla_lf_pf(table, host, torch.arange(2), make(), D * 4, L * D * 4, L)
    assert len(staged) == 1


def _write_back_routing(monkeypatch):
    """A page_first MLA host pool, its device pointer table and SGLang's staging buffer, as stand-ins, with a
    staging area that records what it is asked, and the two other paths recording that they ran."""
    host = fake_gpu.pinned(torch.zeros(16, L, D, dtype=torch.int32))
    table = fake_gpu.cuda(torch.tensor([1, 2, 3], dtype=torch.int64).view(torch.uint64))
    memory = fake_gpu.cuda(torch.zeros(4, L, D, dtype=torch.int32))  # SGLang's staging buffer: 4 tokens
    seen = []
    area = type("Area", (), {"backup": lambda self, dst, src, **kw: seen.append(("staged", kw)) or True})()
    monkeypatch.setattr(routed, "kernel_available", lambda size: True)
    monkeypatch.setattr(routed.route, "routed_stages", lambda **kwargs: True)
    monkeypatch.setattr(routed.route, "WRITE_BACK_MIN_CHUNK_TOKENS", 2)
    monkeypatch.setattr(routed.pointer_tables, "checked", lambda t, name: type(
        "Checked", (), {"rows": lambda self, stride, row, name: 16})())
    monkeypatch.setattr(routed.compat, "transfer_hicache_all_layer_mla_staged_lf_pf",
                        lambda *a, **kw: seen.append(("kernel", {})))
    monkeypatch.setattr(routed, "_all_layers", lambda *a, **kw: seen.append(("kernel", {})))
    monkeypatch.setattr(routed.compat, "host_layer_table", lambda *a: None)  # built on a GPU; _all_layers is stubbed
    monkeypatch.setitem(routed._stagings, (host.data_ptr(), table.data_ptr(), D * 4, L, 16, memory.data_ptr()),
                        (lambda: routed.compat._root(host), routed.settings.staging_bytes(), area))
    return host, table, memory, seen


def test_the_staged_write_back_stages_with_device_indices_on_the_gpu_and_host_indices_on_the_cpu(monkeypatch):
    """SGLang's staged write-back keeps the host indices on the CPU and hands the device indices on the GPU: the
    routed op stages it in SGLang's buffer, asking the area to bound the device indices on the GPU (reading them
    would stall the scheduler). Host indices on the GPU (a release that moves them) go to the kernel, and the
    sgl-kernel op with GPU device indices stays the kernel's (its padding rule: a negative index skips)."""
    host, table, memory, seen = _write_back_routing(monkeypatch)
    on_gpu = fake_gpu.cuda(torch.arange(2))
    routed.transfer_hicache_all_layer_mla_staged_lf_pf(table, on_gpu, torch.arange(2), memory, host, page_size=1)
    assert seen == [("staged", {"bound_on_gpu": True})]
    seen.clear()
    routed.transfer_hicache_all_layer_mla_staged_lf_pf(table, on_gpu, fake_gpu.cuda(torch.arange(2)), memory, host,
                                                       page_size=1)
    assert seen == [("kernel", {})]
    seen.clear()
    routed.transfer_kv_all_layer_mla_lf_pf(table, host, on_gpu, torch.arange(2), D * 4, L * D * 4, L)
    assert seen == [("kernel", {})]
    seen.clear()
    with pytest.raises(ValueError, match="dst_indices has 3 entries but src_indices has 2"):
        routed.transfer_hicache_all_layer_mla_staged_lf_pf(table, on_gpu, torch.arange(3), memory, host, page_size=1)
    assert seen == []


def test_a_staging_buffer_too_small_for_two_chunks_leaves_the_write_back_to_the_kernel(monkeypatch):
    host, table, memory, seen = _write_back_routing(monkeypatch)
    monkeypatch.setattr(routed.route, "WRITE_BACK_MIN_CHUNK_TOKENS", 3)  # 4 tokens: halves of 2
    routed.transfer_hicache_all_layer_mla_staged_lf_pf(table, fake_gpu.cuda(torch.arange(2)), torch.arange(2),
                                                       memory, host, page_size=1)
    assert seen == [("kernel", {})]
    monkeypatch.setenv("SGLANG_HICACHE_JIT_STAGING", "0")  # staging off: SGLang's buffer is not used either
    monkeypatch.setattr(routed.route, "WRITE_BACK_MIN_CHUNK_TOKENS", 2)
    seen.clear()
    routed.transfer_hicache_all_layer_mla_staged_lf_pf(table, fake_gpu.cuda(torch.arange(2)), torch.arange(2),
                                                       memory, host, page_size=1)
    assert seen == [("kernel", {})]
