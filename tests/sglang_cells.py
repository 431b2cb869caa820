"""Runs SGLang's own host pools through the plugin, one cell at a time, on any release 0.5.16+.

Started in a fresh process (the plugin patches process-wide state) by
test_sglang_integration.py (the installed SGLang) and test_sglang_releases.py
(each recorded release, unpacked from its wheel), with a generated sgl_kernel
stand-in first on the path: sgl-kernel is present, with the signatures of the
version the release pins, but every op in it raises. Prints one JSON line per
cell: {"cell", "ok", "error", "path", ...} and a summary line.

Pools are built the way each release builds them, found by feature, not by
version: from buffer infos (0.5.23+), or from a device pool (up to 0.5.22).
Where a release takes a device pool, a stand-in is passed whose every
attribute is one the release's own device-pool classes define (construct
mode checks that, and that each hook the plugin registered finds every pool
attribute it declares on the pools built).

Modes:
  plugin     only load the plugin and print what it patched
  construct  build every pool of the matrix (no transfer); runs without a GPU
  transfer   also back up all layers, then load each layer back, and check
             bit for bit against torch indexing, including that slots not
             addressed are untouched (needs a GPU)
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import sys
import traceback
from dataclasses import dataclass
from types import SimpleNamespace

import torch

PAGE = 16
DEVICE_PAGES = 24
LAYERS = 4
SHARD = (1, 3)  # owned device layers [1, 3) when sharded (a shard size of 2)


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


def _takes(cls, name: str) -> bool:
    return name in inspect.signature(cls.__init__).parameters


def _pool_class(module: str, legacy: str, name: str):
    """A pool class from its pool_host module, or from memory_pool_host where the release keeps it."""
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return getattr(importlib.import_module(legacy), name)


_LEGACY = "sglang.srt.mem_cache.memory_pool_host"
# Where the device-pool classes that stand-ins stand in for live.
DEVICE_POOL_CLASSES = {"MLATokenToKVPool": "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool",
                       "DSATokenToKVPool": "sglang.srt.mem_cache.memory_pool.DSATokenToKVPool",
                       "MHATokenToKVPool": "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool",
                       "LayerSplitDSATokenToKVPool":
                           "sglang.srt.mem_cache.dsa_cache_layer_split.LayerSplitDSATokenToKVPool"}


# ---------------------------------------------------------------------------
# Pools, built the way each release's assembler builds them.

@dataclass
class Built:
    host: object
    device_pool: object  # what the pool's transfer methods take as their device pool (None: they hold it)
    layers: dict  # device layer id -> its device tensor (MLA) or (K, V) tensors (MHA)
    pools: list  # every host pool to destroy


def device_rows(slots: int, row: tuple, dtype, device, *, strided: bool):
    """One device layer: [slots, *row], optionally a strided view of wider rows."""
    if strided:  # the unified pool's token-major entries: dense rows, further apart than their width
        width = row[0] * row[-1]
        wide = _random_(torch.empty((slots, width + 32), dtype=dtype, device=device))
        return wide[:, :width].unflatten(1, row)
    return _random_(torch.empty((slots, *row), dtype=dtype, device=device))


# Every device-pool stand-in made, with the classes whose attributes it stands in for (checked in construct mode).
standins: list = []


def _standin(roles: tuple, **attributes) -> SimpleNamespace:
    pool = SimpleNamespace(**attributes)
    standins.append((roles, pool))
    return pool


def _table(tensors, device):
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64, device=device)


def _mla_device_pool(*, owned, sharded, dtype, dim, device, strided):
    """An MLATokenToKVPool stand-in; a layer-sharded one keeps 0-row placeholders for layers it does not own,
    as LayerSplitDSATokenToKVPool does, so kv_buffer stays indexed by layer."""
    slots = DEVICE_PAGES * PAGE
    buffers = [device_rows(slots if layer in owned else 0, (1, dim), dtype, device, strided=strided)
               for layer in range(LAYERS)]
    roles = ("MLATokenToKVPool", "DSATokenToKVPool", "LayerSplitDSATokenToKVPool")
    return _standin(roles, store_dtype=dtype, dtype=dtype, size=slots, page_size=PAGE, start_layer=0,
                    end_layer=LAYERS - 1, layer_num=LAYERS, kv_lora_rank=dim - 64, qk_rope_head_dim=64,
                    kv_cache_dim=dim, kv_buffer=buffers, data_ptrs=_table(buffers, device), device=device,
                    layer_shard_enabled=sharded, layer_shard_size=2,
                    _owned_local_layer_range=lambda: (owned.start, owned.stop))


def mla_pool(*, layout, sharded, dtype, dim, device, pin, strided=False) -> Built:
    cls = _pool_class("sglang.srt.mem_cache.pool_host.mla", _LEGACY, "MLATokenToKVPoolHost")
    slots = DEVICE_PAGES * PAGE
    owned = range(*SHARD) if sharded else range(LAYERS)
    if _takes(cls, "buffer_info"):  # 0.5.23+: buffer infos of the device tensors
        from sglang.srt.mem_cache.device_pool_info import MLABufferInfo

        buffers = tuple(device_rows(slots, (1, dim), dtype, device, strided=strided) for _ in owned)
        info = MLABufferInfo(buffers=buffers, data_ptrs=_table(buffers, device), layer_indices=tuple(owned),
                             device_layer_num=LAYERS, page_size=PAGE, kv_lora_rank=dim - 64, qk_rope_head_dim=64,
                             kv_cache_dim=dim, dtype=dtype, device=torch.device(device))
        host = cls(info, 2.0, 0, PAGE, layout, pin_memory=pin, override_kv_cache_dim=dim,
                   device_capacity_tokens=slots, start_layer=0, end_layer=LAYERS, target_layer_num=len(owned),
                   layer_shard_enabled=sharded)
        return Built(host, None, {layer: buffers[i] for i, layer in enumerate(owned)}, [host])
    device_pool = _mla_device_pool(owned=owned, sharded=sharded, dtype=dtype, dim=dim, device=device, strided=strided)
    host = cls(device_pool, 2.0, 0, PAGE, layout, pin_memory=pin, override_kv_cache_dim=dim)
    return Built(host, device_pool, {layer: device_pool.kv_buffer[layer] for layer in owned}, [host])


def mha_pool(*, layout, dtype, heads, head_dim, device, pin, strided=False) -> Built:
    mha = __import__("sglang.srt.mem_cache.pool_host.mha", fromlist=["get_mha_host_pool_cls"])
    slots = DEVICE_PAGES * PAGE
    k = tuple(device_rows(slots, (heads, head_dim), dtype, device, strided=strided) for _ in range(LAYERS))
    v = tuple(device_rows(slots, (heads, head_dim), dtype, device, strided=strided) for _ in range(LAYERS))
    layers = {layer: (k[layer], v[layer]) for layer in range(LAYERS)}
    if _takes(mha.MHATokenToKVPoolHost, "buffer_info"):  # 0.5.23+
        from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo

        info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=_table(k, device), v_data_ptrs=_table(v, device),
                                               layout=KVBufferLayout.NHD),
                             page_size=PAGE, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=dtype,
                             device=torch.device(device))
        host = mha.get_mha_host_pool_cls(info)(info, 2.0, 0, PAGE, layout, pin_memory=pin,
                                               device_capacity_tokens=slots, start_layer=0, end_layer=LAYERS)
        return Built(host, None, layers, [host])
    device_pool = _standin(("MHATokenToKVPool",), store_dtype=dtype, dtype=dtype, size=slots, page_size=PAGE,
                           start_layer=0, end_layer=LAYERS - 1, layer_num=LAYERS, head_num=heads, head_dim=head_dim,
                           v_head_dim=head_dim, row_dim=heads * head_dim, k_buffer=list(k), v_buffer=list(v),
                           k_data_ptrs=_table(k, device), v_data_ptrs=_table(v, device), device=device,
                           layer_shard_enabled=False)
    host = mha.get_mha_host_pool_cls(device_pool)(device_pool, 2.0, 0, PAGE, layout, pin_memory=pin)
    return Built(host, device_pool, layers, [host])


def dsa_pool(*, layout, sharded, device, pin) -> Built:
    """The DSA indexer host pool on an MLA anchor, with a device pool holding one index buffer of whole
    pages per device layer, as DSATokenToKVPool keeps."""
    cls = _pool_class("sglang.srt.mem_cache.pool_host.dsa", _LEGACY, "DSAIndexerPoolHost")
    anchor = mla_pool(layout=layout, sharded=sharded, dtype=torch.uint8, dim=656, device=device, pin=pin)
    index_head_dim, quant_block = 128, 128
    page_bytes = PAGE * (index_head_dim + index_head_dim // quant_block * 4)
    owned = SHARD if sharded else (0, LAYERS)
    index = [_random_(torch.empty((DEVICE_PAGES + 1, page_bytes), dtype=torch.uint8, device=device))
             for _ in range(LAYERS)]
    device_pool = anchor.device_pool or _mla_device_pool(owned=range(*owned), sharded=sharded, dtype=torch.uint8,
                                                         dim=656, device=device, strided=False)
    device_pool.index_head_dim, device_pool.quant_block_size = index_head_dim, quant_block
    device_pool.index_k_with_scale_buffer = index
    if _takes(cls, "decl"):  # 0.5.22+: a pool declaration from the device pool
        from sglang.srt.mem_cache.pool_host.dsa import make_dsa_indexer_pool_decl

        device_pool.index_page_size, device_pool.skip_topk_layers = PAGE, [False] * LAYERS  # the declaration reads them
        host = cls(decl=make_dsa_indexer_pool_decl(device_pool), anchor_host=anchor.host, pin_memory=pin)
    else:
        host = cls(device_pool, anchor.host, layout, pin_memory=pin)
    return Built(host, device_pool, {layer: index[layer] for layer in range(*owned)}, [host, anchor.host])


# ---------------------------------------------------------------------------
# Reading host rows by layout, not through the pool's own views.

def _host_layer(built: Built, layer: int) -> int:
    """The host layer of a device layer: the pool's own map (0.5.23), else its owned range (sharded pools)."""
    by_controller = getattr(built.host, "_host_layer_by_controller", None)
    if by_controller is not None:
        return by_controller[layer]
    if built.device_pool is not None and getattr(built.device_pool, "layer_shard_enabled", False):
        return built.host._host_layer_index(layer, built.device_pool)
    return layer


def _layer_rows(buf: torch.Tensor, layout: str, layer: int) -> torch.Tensor:
    """Rows of host layer ``layer`` as a (tokens, row) tensor."""
    if layout == "layer_first":
        return buf[layer].reshape(buf.shape[1], -1)
    if layout == "page_first":
        return buf[:, layer].reshape(buf.shape[0], -1)
    return buf[:, layer].reshape(buf.shape[0] * buf.shape[2], -1)  # page_first_direct


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


def _registrations() -> int:
    """The package's registry generation, once every dead tensor's finalizer has run."""
    import gc

    from sglang_hicache_jit.transfer import extents

    gc.collect()
    return extents.Generation.value


def _registered_nothing(generation: int, what: str) -> None:
    """A pool's calls after its first must register no memory: a registration makes every checked pointer
    table be checked again, and a CUDA table is then read back, a device sync in SGLang's scheduler thread
    (a real server's misses were 26-28 ms slower per 8K-token chunk from it, SGLang 0.5.17's MHA pool)."""
    from sglang_hicache_jit.transfer import extents

    if extents.Generation.value != generation:
        raise AssertionError(f"{what} registered memory again (registry generation {generation} -> "
                             f"{extents.Generation.value}): each such call reads pointer tables back from the GPU")


def run_mla_or_mha(kind: str, built: Built, io_backend: str, generator) -> None:
    host = built.host
    layer_ids = sorted(built.layers)
    if kind == "mla":
        views = lambda hl: [_layer_rows(host.kv_buffer, host.layout, hl)]  # noqa: E731
        dev_of = lambda layer: [built.layers[layer]]  # noqa: E731
    else:
        views = lambda hl: [_layer_rows(host.kv_buffer[0], host.layout, hl),  # noqa: E731
                            _layer_rows(host.kv_buffer[1], host.layout, hl)]
        dev_of = lambda layer: list(built.layers[layer])  # noqa: E731
    host_pages = _pages(6, host.page_num - 1, generator)
    dev_pages = _pages(6, DEVICE_PAGES, generator)
    host_idx, dev_idx = _tokens(host_pages), _tokens(dev_pages).cuda()
    _random_(host.kv_buffer)
    before = {layer: [v.clone() for v in views(_host_layer(built, layer))] for layer in layer_ids}
    host.backup_from_device_all_layer(built.device_pool, host_idx, dev_idx, io_backend)
    torch.cuda.synchronize()
    for layer in layer_ids:
        for after, old, dev in zip(views(_host_layer(built, layer)), before[layer], dev_of(layer)):
            _expect_rows(after, old, host_idx, dev.reshape(dev.shape[0], -1)[dev_idx], f"backup layer {layer}")
    generation = _registrations()
    host.backup_from_device_all_layer(built.device_pool, host_idx, dev_idx, io_backend)  # as SGLang: every call
    torch.cuda.synchronize()
    _registered_nothing(generation, "a second backup")
    # Load back into other device slots, over fresh random device data.
    load_idx = _tokens(_pages(6, DEVICE_PAGES, generator)).cuda()
    for layer in layer_ids:
        for dev in dev_of(layer):
            _random_(dev)
    dev_before = {layer: [d.clone() for d in dev_of(layer)] for layer in layer_ids}
    generation = _registrations()
    for layer in layer_ids:
        host.load_to_device_per_layer(built.device_pool, host_idx, load_idx, layer, io_backend)
    torch.cuda.synchronize()
    _registered_nothing(generation, "the loads")
    for layer in layer_ids:
        for dev, old, hv in zip(dev_of(layer), dev_before[layer], views(_host_layer(built, layer))):
            _expect_rows(dev.reshape(dev.shape[0], -1), old.reshape(old.shape[0], -1), load_idx.cpu(), hv[host_idx],
                         f"load layer {layer}")


def run_dsa(built: Built, io_backend: str, generator) -> None:
    host, device_pool = built.host, built.device_pool
    owned = sorted(built.layers)
    host_pages = _pages(5, host.page_num - 1, generator)
    dev_pages = _pages(5, DEVICE_PAGES, generator)
    host_idx, dev_idx = _tokens(host_pages), _tokens(dev_pages).cuda()
    _random_(host.index_k_with_scale_buffer)
    before = {layer: dsa_host_layer(host, _host_layer(built, layer)).clone() for layer in owned}
    host.backup_from_device_all_layer(device_pool, host_idx, dev_idx, io_backend)
    torch.cuda.synchronize()
    for layer in owned:
        dev = built.layers[layer]
        _expect_rows(dsa_host_layer(host, _host_layer(built, layer)), before[layer], host_pages,
                     dev[dev_pages.cuda()], f"indexer backup layer {layer}")
    load_pages = _pages(5, DEVICE_PAGES, generator)
    for layer in owned:
        _random_(built.layers[layer])
    dev_before = {layer: built.layers[layer].clone() for layer in owned}
    for layer in owned:
        host.load_to_device_per_layer(device_pool, host_idx, _tokens(load_pages).cuda(), layer, io_backend)
    torch.cuda.synchronize()
    for layer in owned:
        _expect_rows(built.layers[layer], dev_before[layer], load_pages,
                     dsa_host_layer(host, _host_layer(built, layer))[host_pages], f"indexer load layer {layer}")


# ---------------------------------------------------------------------------

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
BACKENDS = ("kernel", "direct")


def _strided_rows_supported() -> bool:
    """Device rows further apart than their width (the unified pool's views) exist from 0.5.22."""
    from sglang.srt.mem_cache.pool_host.base import HostKVCache

    return hasattr(HostKVCache, "_init_device_row_stride")


def cells():
    for layout, backend, sharded in itertools.product(LAYOUTS, BACKENDS, (False, True)):
        shard = "sharded" if sharded else "full"
        yield f"mla-bf16/{layout}/{backend}/{shard}", ("mla", layout, backend, sharded, torch.bfloat16, 576, False)
        yield f"mla-fp8/{layout}/{backend}/{shard}", ("mla", layout, backend, sharded, torch.uint8, 576, False)
        yield f"dsa-indexer/{layout}/{backend}/{shard}", ("dsa", layout, backend, sharded, None, None, False)
    for layout, backend in itertools.product(LAYOUTS, BACKENDS):
        yield f"mha-llama8b/{layout}/{backend}/full", ("mha", layout, backend, False, torch.bfloat16, 128, False)
        yield f"mha-small/{layout}/{backend}/full", ("mha1", layout, backend, False, torch.bfloat16, 128, False)
    # The seed's cell: a layer-sharded FP8 MLA pool whose own JIT check said no (upstream's predicate refuses
    # 576-B rows, or its JIT build failed), backed up with page_first + kernel.
    yield "mla-fp8-jit-refused/page_first/kernel/sharded", ("mla-refused", "page_first", "kernel", True,
                                                            torch.uint8, 576, False)
    if _strided_rows_supported():
        for layout, backend in itertools.product(("layer_first", "page_first"), BACKENDS):
            yield f"mla-bf16-strided/{layout}/{backend}/full", ("mla", layout, backend, False, torch.bfloat16, 576,
                                                                True)
            yield f"mha-strided/{layout}/{backend}/full", ("mha", layout, backend, False, torch.bfloat16, 128, True)


def run_cell(spec, *, transfer: bool, device: str, generator, record: dict, built_pools: list) -> None:
    kind, layout, backend, sharded, dtype, dim, strided = spec
    pin = device != "cpu"
    if kind in ("mla", "mla-refused"):
        built = mla_pool(layout=layout, sharded=sharded, dtype=dtype, dim=dim, device=device, pin=pin,
                         strided=strided)
        built_pools += built.pools
        if kind == "mla-refused":
            built.host.can_use_jit = False  # the state upstream's own predicate leaves such a pool in
        record["can_use_jit"] = bool(built.host.can_use_jit)
        if transfer:
            run_mla_or_mha("mla", built, backend, generator)
    elif kind in ("mha", "mha1"):
        built = mha_pool(layout=layout, dtype=dtype, heads=8 if kind == "mha" else 1, head_dim=dim, device=device,
                         pin=pin, strided=strided)
        built_pools += built.pools
        record["can_use_jit"] = bool(built.host.can_use_jit)
        if transfer:
            run_mla_or_mha("mha", built, backend, generator)
    else:
        built = dsa_pool(layout=layout, sharded=sharded, device=device, pin=pin)
        built_pools += built.pools
        if transfer:
            run_dsa(built, backend, generator)
    record["pool"] = type(built.host).__name__


def release(pool) -> None:
    """Unregisters a pool's pinned host memory, so the next cell can register memory at the same address.
    DSA indexer pools before 0.5.22 leave their index buffer registered (one pool per process in a server)."""
    index = getattr(pool, "index_k_with_scale_buffer", None)
    releases_index = "destroy" in vars(type(pool))
    pool.destroy()
    if index is not None and not releases_index and pool.pin_memory and torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(index.data_ptr())


def missing_needs(pool, decisions) -> list:
    """Attributes that a hook registered on the pool's class declares it needs but the built pool lacks."""
    import pkgutil

    missing = []
    for d in decisions:
        if not d.patched or d.target.kind != "AROUND":
            continue
        owner = pkgutil.resolve_name(d.path.rpartition(".")[0])
        if isinstance(pool, owner):
            missing += [f"{d.hook.__name__}: {a}" for a in sorted(d.hook.needs.attributes) if not hasattr(pool, a)]
    return missing


def standin_surplus() -> list:
    """Attributes of the device-pool stand-ins made that none of the classes they stand in for defines."""
    from sglang_hicache_jit.integrations.sglang.plan import LiveFacts

    facts, surplus = LiveFacts(), set()
    defined = {}
    for roles, pool in standins:
        names = set()
        for role in roles:
            if role not in defined:
                path = DEVICE_POOL_CLASSES[role]
                defined[role] = set() if facts.missing(path) else facts.class_attributes(path)
            names |= defined[role]
        surplus |= {f"{'/'.join(roles)}.{a}" for a in vars(pool) if a not in names}
    return sorted(surplus)


def upstream_predicate(element_size: int):
    """What the release's own can_use_hicache_jit_kernel answers (the routed one wraps it), or None."""
    import importlib

    for module in ("sglang.kernels.ops.kvcache.hicache", "sglang.jit_kernel.hicache"):
        try:
            fn = importlib.import_module(module).can_use_hicache_jit_kernel
        except (ImportError, AttributeError):
            continue
        original = getattr(fn, "__wrapped__", fn)
        try:
            return bool(original(element_size=element_size))
        except Exception as exc:  # upstream's check failing is an answer too: it would not use its kernel
            return f"raised {type(exc).__name__}"
    return None


def main() -> int:
    from release_kit import tolerate_newer_transformers

    tolerate_newer_transformers()
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("plugin", "construct", "transfer"))
    parser.add_argument("--only", default="", help="run cells whose name contains this")
    args = parser.parse_args()
    status = load_plugin()
    from importlib.metadata import version

    print(json.dumps({"sglang": version("sglang"), "plugin": {k: status[k] for k in ("registered", "reason")},
                      "patched": status["patched"], "skipped": status["skipped"],
                      "absent": [name for name, _ in status["absent"]]}), flush=True)
    from sglang_hicache_jit.transfer import route
    from sglang_hicache_jit.integrations.sglang.plan import LiveFacts, plan

    if args.mode == "plugin":  # what the plugin patched, no pools (releases without layer-sharded pools)
        print(json.dumps({"summary": {"cells": 0, "failed": 0}}), flush=True)
        return 0
    decisions = plan(LiveFacts())
    transfer = args.mode == "transfer"
    device = "cuda:0" if transfer else "cpu"
    generator = torch.Generator().manual_seed(0)
    failed = total = 0
    for name, spec in cells():
        if args.only not in name:
            continue
        total += 1
        record = {"cell": name, "ok": True, "error": ""}
        if spec[0] == "mla-refused":
            record["upstream_predicate_576"] = upstream_predicate(576)
        pools: list = []  # destroyed whatever happens: a pool's host memory stays registered with CUDA until then
        try:
            run_cell(spec, transfer=transfer, device=device, generator=generator, record=record, built_pools=pools)
            lacking = [m for pool in pools for m in missing_needs(pool, decisions)]
            if lacking:
                raise AssertionError(f"registered hooks need what the pool lacks: {lacking}")
            if transfer:
                record["path"] = {str(k): ("kernel" if v else "direct") for k, v in route._verdicts.items()}
        except Exception as exc:
            failed += 1
            record.update(ok=False, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:])
        finally:
            for pool in pools:
                release(pool)
        print(json.dumps(record), flush=True)
    surplus = standin_surplus()
    if surplus:
        failed += 1
        print(json.dumps({"cell": "device-pool stand-ins", "ok": False,
                          "error": f"attributes no device-pool class of this release defines: {surplus}"}), flush=True)
    print(json.dumps({"summary": {"cells": total, "failed": failed}}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
