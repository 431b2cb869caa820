"""Runs SGLang 0.5.23's own host pools through the plugin, one cell at a time.

Started by test_sglang_integration.py in a fresh process (the plugin patches
process-wide state), with tests/sglang_stubs first on PYTHONPATH so that
sgl-kernel is present but every op in it raises. Prints one JSON line per
cell: {"cell", "ok", "error", "path"} and a summary line.

Modes:
  construct  build every pool of the matrix (no transfer); runs without a GPU
  transfer   also back up all layers, then load each layer back, and check
             bit for bit against torch indexing, including that slots not
             addressed are untouched (needs a GPU)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import traceback
from types import SimpleNamespace

import torch

PAGE = 16
DEVICE_PAGES = 24
LAYERS = 4
SHARD = (1, 3)  # owned device layers [1, 3) when sharded


def load_plugin() -> dict:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang_hicache_jit.integrations.sglang import status

    return status


def _random_(t: torch.Tensor) -> torch.Tensor:
    t.view(torch.uint8).random_(0, 256)
    return t


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)


# ---------------------------------------------------------------------------
# Pools, built the way the assembler builds them (buffer infos from device tensors).

def device_rows(slots: int, row: tuple, dtype, device, *, strided: bool):
    """One device layer: [slots, *row], optionally a strided view of wider rows."""
    if strided:  # the unified pool's token-major entries: dense rows, further apart than their width
        width = row[0] * row[-1]
        wide = _random_(torch.empty((slots, width + 32), dtype=dtype, device=device))
        return wide[:, :width].unflatten(1, row)
    return _random_(torch.empty((slots, *row), dtype=dtype, device=device))


def mla_pool(*, layout, sharded, dtype, dim, device, pin, strided=False):
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    slots = DEVICE_PAGES * PAGE
    owned = range(*SHARD) if sharded else range(LAYERS)
    buffers = tuple(device_rows(slots, (1, dim), dtype, device, strided=strided) for _ in owned)
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64, device=device)
    info = MLABufferInfo(buffers=buffers, data_ptrs=ptrs, layer_indices=tuple(owned), device_layer_num=LAYERS,
                         page_size=PAGE, kv_lora_rank=dim - 64, qk_rope_head_dim=64, kv_cache_dim=dim, dtype=dtype,
                         device=torch.device(device))
    host = MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=pin, override_kv_cache_dim=dim,
                                device_capacity_tokens=slots, start_layer=0, end_layer=LAYERS,
                                target_layer_num=len(owned), layer_shard_enabled=sharded)
    layers = {layer: buffers[i] for i, layer in enumerate(owned)}
    return host, layers


def mla_host_layer(host, layer: int) -> torch.Tensor:
    """Rows of host layer ``layer`` as a (tokens, row) tensor, read by layout, not by the pool's views."""
    buf = host.kv_buffer
    if host.layout == "layer_first":
        return buf[layer].reshape(buf.shape[1], -1)
    if host.layout == "page_first":
        return buf[:, layer].reshape(buf.shape[0], -1)
    return buf[:, layer].reshape(buf.shape[0] * buf.shape[2], -1)  # page_first_direct


def mha_pool(*, layout, dtype, heads, head_dim, device, pin, strided=False):
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

    slots = DEVICE_PAGES * PAGE
    k = tuple(device_rows(slots, (heads, head_dim), dtype, device, strided=strided) for _ in range(LAYERS))
    v = tuple(device_rows(slots, (heads, head_dim), dtype, device, strided=strided) for _ in range(LAYERS))
    table = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64, device=device)  # noqa: E731
    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=table(k), v_data_ptrs=table(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=PAGE, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=dtype,
                         device=torch.device(device))
    cls = get_mha_host_pool_cls(info)
    host = cls(info, 2.0, 0, PAGE, layout, pin_memory=pin, device_capacity_tokens=slots, start_layer=0,
               end_layer=LAYERS)
    return host, {layer: (k[layer], v[layer]) for layer in range(LAYERS)}


def mha_host_layer(host, layer: int, which: int) -> torch.Tensor:
    buf = host.kv_buffer[which]
    if host.layout == "layer_first":
        return buf[layer].reshape(buf.shape[1], -1)
    if host.layout == "page_first":
        return buf[:, layer].reshape(buf.shape[0], -1)
    return buf[:, layer].reshape(buf.shape[0] * buf.shape[2], -1)


def dsa_pool(*, layout, sharded, device, pin):
    """The DSA indexer host pool on an MLA anchor, with a stand-in device pool
    (one index buffer of whole pages per device layer, as DSATokenToKVPool keeps)."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl

    anchor, _ = mla_pool(layout=layout, sharded=sharded, dtype=torch.uint8, dim=656, device=device, pin=pin)
    index_head_dim, quant_block = 128, 128
    page_bytes = PAGE * (index_head_dim + index_head_dim // quant_block * 4)
    owned = SHARD if sharded else (0, LAYERS)
    dtype = DSATokenToKVPool.index_k_with_scale_buffer_dtype
    index = [_random_(torch.empty((DEVICE_PAGES + 1, page_bytes), dtype=dtype, device=device))
             for _ in range(LAYERS)]
    device_pool = SimpleNamespace(
        index_page_size=PAGE, index_head_dim=index_head_dim, quant_block_size=quant_block, page_size=PAGE,
        skip_topk_layers=[False] * LAYERS, store_dtype=torch.uint8, start_layer=0, end_layer=LAYERS,
        layer_num=LAYERS, device=device, index_k_with_scale_buffer=index, layer_shard_enabled=sharded,
        layer_shard_size=2, _owned_local_layer_range=lambda: owned)
    host = DSAIndexerPoolHost(decl=make_dsa_indexer_pool_decl(device_pool), anchor_host=anchor, pin_memory=pin)
    return host, device_pool, range(*owned), anchor


def dsa_host_layer(host, layer: int) -> torch.Tensor:
    buf = host.index_k_with_scale_buffer
    if host.layout == "layer_first":
        return buf[layer]
    return buf[:, layer].reshape(buf.shape[0], -1)


# ---------------------------------------------------------------------------
# Checks.

def _pages(count: int, total: int, generator) -> torch.Tensor:
    return torch.randperm(total, generator=generator)[:count]


def _tokens(pages: torch.Tensor) -> torch.Tensor:
    return (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)


def _expect_rows(after: torch.Tensor, before: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, what: str):
    """``after`` equals ``before`` except at ``rows``, which hold ``values``; all compared as bytes."""
    expected = _bytes(before).cpu().clone()
    expected[rows.cpu()] = _bytes(values).cpu()
    got = _bytes(after).cpu()
    if not torch.equal(got, expected):
        bad = (got != expected).any(dim=1).nonzero().flatten()[:5].tolist()
        raise AssertionError(f"{what}: {int((got != expected).any(dim=1).sum())} rows differ (first: {bad})")


def run_mla_or_mha(kind: str, host, layers: dict, io_backend: str, generator) -> None:
    layer_ids = sorted(layers)
    host_layer = (host._host_layer_by_controller if kind == "mla" else {layer: layer for layer in layer_ids})
    views = {"mla": lambda h, hl: [mla_host_layer(h, hl)],
             "mha": lambda h, hl: [mha_host_layer(h, hl, 0), mha_host_layer(h, hl, 1)]}[kind]
    dev_of = (lambda layer: [layers[layer]]) if kind == "mla" else (lambda layer: list(layers[layer]))
    host_pages = _pages(6, host.page_num - 1, generator)
    dev_pages = _pages(6, DEVICE_PAGES, generator)
    host_idx, dev_idx = _tokens(host_pages), _tokens(dev_pages).cuda()
    _random_(host.kv_buffer)
    before = {layer: [v.clone() for v in views(host, host_layer[layer])] for layer in layer_ids}
    host.backup_from_device_all_layer(None, host_idx, dev_idx, io_backend)
    torch.cuda.synchronize()
    for layer in layer_ids:
        for after, old, dev in zip(views(host, host_layer[layer]), before[layer], dev_of(layer)):
            _expect_rows(after, old, host_idx, dev.reshape(dev.shape[0], -1)[dev_idx], f"backup layer {layer}")
    # Load back into other device slots, over fresh random device data.
    load_pages = _pages(6, DEVICE_PAGES, generator)
    load_idx = _tokens(load_pages).cuda()
    for layer in layer_ids:
        for dev in dev_of(layer):
            _random_(dev)
    dev_before = {layer: [d.clone() for d in dev_of(layer)] for layer in layer_ids}
    for layer in layer_ids:
        host.load_to_device_per_layer(None, host_idx, load_idx, layer, io_backend)
    torch.cuda.synchronize()
    for layer in layer_ids:
        for dev, old, hv in zip(dev_of(layer), dev_before[layer], views(host, host_layer[layer])):
            _expect_rows(dev.reshape(dev.shape[0], -1), old.reshape(old.shape[0], -1), load_idx.cpu(), hv[host_idx],
                         f"load layer {layer}")


def run_dsa(host, device_pool, owned, io_backend: str, generator) -> None:
    host_pages = _pages(5, host.page_num - 1, generator)
    dev_pages = _pages(5, DEVICE_PAGES, generator)
    host_idx, dev_idx = _tokens(host_pages), _tokens(dev_pages).cuda()
    _random_(host.index_k_with_scale_buffer)
    before = {layer: dsa_host_layer(host, host._host_layer_index(layer)).clone() for layer in owned}
    host.backup_from_device_all_layer(device_pool, host_idx, dev_idx, io_backend)
    torch.cuda.synchronize()
    for layer in owned:
        dev = device_pool.index_k_with_scale_buffer[layer]
        _expect_rows(dsa_host_layer(host, host._host_layer_index(layer)), before[layer], host_pages,
                     dev[dev_pages.cuda()], f"indexer backup layer {layer}")
    load_pages = _pages(5, DEVICE_PAGES, generator)
    for layer in owned:
        _random_(device_pool.index_k_with_scale_buffer[layer])
    dev_before = {layer: device_pool.index_k_with_scale_buffer[layer].clone() for layer in owned}
    for layer in owned:
        host.load_to_device_per_layer(device_pool, host_idx, _tokens(load_pages).cuda(), layer, io_backend)
    torch.cuda.synchronize()
    for layer in owned:
        _expect_rows(device_pool.index_k_with_scale_buffer[layer], dev_before[layer], load_pages,
                     dsa_host_layer(host, host._host_layer_index(layer))[host_pages], f"indexer load layer {layer}")


# ---------------------------------------------------------------------------

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
BACKENDS = ("kernel", "direct")


def cells():
    for layout, backend, sharded in itertools.product(LAYOUTS, BACKENDS, (False, True)):
        yield f"mla-bf16/{layout}/{backend}/{'sharded' if sharded else 'full'}", ("mla", layout, backend, sharded,
                                                                                  torch.bfloat16, 576, False)
        yield f"mla-fp8/{layout}/{backend}/{'sharded' if sharded else 'full'}", ("mla", layout, backend, sharded,
                                                                                 torch.uint8, 576, False)
        yield f"dsa-indexer/{layout}/{backend}/{'sharded' if sharded else 'full'}", ("dsa", layout, backend,
                                                                                     sharded, None, None, False)
    for layout, backend in itertools.product(LAYOUTS, BACKENDS):
        yield f"mha-llama8b/{layout}/{backend}/full", ("mha", layout, backend, False, torch.bfloat16, 128, False)
        yield f"mha-small/{layout}/{backend}/full", ("mha1", layout, backend, False, torch.bfloat16, 128, False)
    for layout, backend in itertools.product(("layer_first", "page_first"), BACKENDS):
        yield f"mla-bf16-strided/{layout}/{backend}/full", ("mla", layout, backend, False, torch.bfloat16, 576, True)
        yield f"mha-strided/{layout}/{backend}/full", ("mha", layout, backend, False, torch.bfloat16, 128, True)


def run_cell(spec, *, transfer: bool, device: str, generator, record: dict) -> None:
    kind, layout, backend, sharded, dtype, dim, strided = spec
    pin = device != "cpu"
    pools = []  # destroyed whatever happens: a pool's host memory stays registered with CUDA until then
    try:
        if kind == "mla":
            host, layers = mla_pool(layout=layout, sharded=sharded, dtype=dtype, dim=dim, device=device, pin=pin,
                                    strided=strided)
            pools.append(host)
            record["can_use_jit"] = bool(host.can_use_jit)
            if transfer:
                run_mla_or_mha("mla", host, layers, backend, generator)
        elif kind in ("mha", "mha1"):
            heads = 8 if kind == "mha" else 1
            host, layers = mha_pool(layout=layout, dtype=dtype, heads=heads, head_dim=dim, device=device, pin=pin,
                                    strided=strided)
            pools.append(host)
            record["can_use_jit"] = bool(host.can_use_jit)
            if transfer:
                run_mla_or_mha("mha", host, layers, backend, generator)
        else:
            host, device_pool, owned, anchor = dsa_pool(layout=layout, sharded=sharded, device=device, pin=pin)
            pools += [host, anchor]
            if transfer:
                run_dsa(host, device_pool, owned, backend, generator)
    finally:
        for pool in pools:
            pool.destroy()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("construct", "transfer"))
    parser.add_argument("--only", default="", help="run cells whose name contains this")
    args = parser.parse_args()
    status = load_plugin()
    print(json.dumps({"plugin": {k: status[k] for k in ("registered", "reason")}, "patched": len(status["patched"]),
                      "skipped": status["skipped"]}), flush=True)
    from sglang_hicache_jit.integrations import sglang_ops

    transfer = args.mode == "transfer"
    device = "cuda:0" if transfer else "cpu"
    generator = torch.Generator().manual_seed(0)
    failed = 0
    total = 0
    for name, spec in cells():
        if args.only not in name:
            continue
        total += 1
        record = {"cell": name, "ok": True, "error": ""}
        try:
            run_cell(spec, transfer=transfer, device=device, generator=generator, record=record)
            if transfer:
                row = sglang_ops._kernel_ok
                record["path"] = {str(k): ("kernel" if v else "direct") for k, v in row.items()}
        except Exception as exc:
            failed += 1
            record.update(ok=False, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:])
        print(json.dumps(record), flush=True)
    print(json.dumps({"summary": {"cells": total, "failed": failed}}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
