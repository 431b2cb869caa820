"""The benchmark's providers: what each name (ceiling, jit[-...], upstream[-...], direct, the PyTorch
baselines) runs for a workload, scope and direction, built as one call to time."""

from __future__ import annotations

from . import upstream
from .upstream import Unavailable
from .workloads import LAYERS, Ceiling, Pools

def _providers(args):
    if args.providers:  # an explicit list may name tuned variants, e.g. jit-bulk-q4-w2-a128, upstream-tma-q8
        return ["ceiling"] + [p for p in args.providers if p != "ceiling"]
    names = ["ceiling", "jit"] + [f"jit-q{q}" for q in args.quotas]
    names += [f"jit-{m}-q{q}" for m in args.methods for q in args.quotas]
    if upstream.importable():  # upstream SGLang's kernels beside ours, at SGLang's own defaults
        names += ["upstream", "upstream-reg", "upstream-tma"]
    return names + ["torch-index", "per-page"]


# Every provider name the benchmark takes, as `bench --help` and the unknown-name error list them.
PROVIDER_NAMES = ("ceiling, jit[-resident][-plain|-bulk][-qN][-rR][-wW][-aA], upstream[-reg|-tma][-qN] (SGLang's "
                  "own kernels), direct[-2d] (the copy engines), torch-index, per-page")


def check_provider(name: str) -> None:
    """ValueError for a provider name the benchmark does not know (checked before anything runs)."""
    if name in ("ceiling", "torch-index", "per-page") or name in DIRECT_PROVIDERS:
        return
    head = name.split("-")[0]
    try:
        if head == "jit":
            _parse_jit_provider(name)
            return
        if head == "upstream":
            upstream.parse(name)
            return
    except (ValueError, IndexError) as exc:
        raise ValueError(f"bad provider {name!r}: {exc}") from None
    raise ValueError(f"unknown provider {name!r} ({PROVIDER_NAMES})")


def family(provider: str) -> str:
    """'ours' (jit*), 'upstream' (upstream*), 'ceiling' or 'baseline' (the PyTorch ways)."""
    if provider == "ceiling":
        return "ceiling"
    if provider.startswith("jit"):
        return "ours"
    return "upstream" if provider.startswith("upstream") else "baseline"


def _build_or_skip(provider, skipped: set, *args):
    """build_call's callable, or None after printing why ``provider`` cannot run here (once per reason)."""
    try:
        return build_call(provider, *args)
    except Unavailable as exc:
        if (provider, str(exc)) not in skipped:
            skipped.add((provider, str(exc)))
            print(f"skipped {provider}: {exc}", flush=True)
        return None


# The copy engines (direct.py) by submission: 'direct' as the pools call it (auto), the others forced.
DIRECT_PROVIDERS = {"direct": "auto", "direct-2d": "2d"}


def build_call(provider, pools: Pools, scope, direction, layer, host_idx, dev_idx, page_size, scratch):
    """A zero-argument callable doing one transfer with ``provider``; Unavailable if it cannot run here."""
    to_device = direction == "h2d"
    if provider.startswith("upstream"):
        up = upstream.module()  # Unavailable without SGLang, before anything touches the GPU
        if pools.layout == "page_first_direct":
            raise Unavailable("SGLang's kernels take page_first_direct pages through its direct backend only")
        return upstream.build_call(up, provider, pools, scope, to_device, layer, host_idx.cuda(),
                                         dev_idx.cuda(), page_size, LAYERS)

    from ..transfer import ops

    host_views = [buf[:, layer] for buf in pools.host]
    dev_views = [layers[layer] for layers in pools.device]
    if pools.layout == "page_first_direct":
        if scope == "all":
            raise Unavailable("page_first_direct is measured one layer at a time")
        # The same bytes read as (pages, LAYERS, page_size, row): a layer's flat rows and its token -> row map.
        from ..transfer import layout

        pages = pools.host_slots // page_size
        host_views = [layout.layer_rows(buf[:pages * page_size].view(pages, LAYERS, page_size, pools.row_bytes),
                                        "page_first_direct", layer) for buf in pools.host]
        host_idx = layout.token_rows("page_first_direct", layers=LAYERS, page_size=page_size,
                                     slots=pages * page_size)(host_idx)
    caches = pools.caches
    host_cuda, dev_cuda = host_idx.cuda(), dev_idx.cuda()
    n = host_idx.numel()

    if provider == "ceiling":
        nbytes = n * pools.row_bytes * caches * (LAYERS if scope == "all" else 1)
        return scratch.setdefault("ceiling", Ceiling()).call(nbytes, direction)

    if provider.startswith("jit"):
        method, quota, tuning = _parse_jit_provider(provider)
        if method and method.startswith("resident"):
            _resident_blocks(ops, tuning.pop("resident_blocks", None))

        # Set for this provider's measurements (the next jit provider sets its own): set per call, it would
        # drop the launch plans on every call and time their rebuild too.
        ops.set_tuning(bulk_warps=tuning.get("bulk_warps", 0), read_align=tuning.get("read_align", 0))
        return _jit_call(ops, pools, scope, to_device, host_views, dev_views, host_cuda, dev_cuda, quota, method)
    if scope == "all":
        pairs = [(pools.host[c][:, l], pools.device[c][l]) for l in range(LAYERS) for c in range(caches)]
    else:
        pairs = list(zip(host_views, dev_views))
    if provider in DIRECT_PROVIDERS:  # the copy engines: one copy per run of slots, batched calls
        from ..transfer import direct

        copy_pairs = direct.Pairs([(dev, host) if to_device else (host, dev) for host, dev in pairs])
        dst_idx, src_idx = (dev_idx, host_idx) if to_device else (host_idx, dev_idx)
        mode = DIRECT_PROVIDERS[provider]
        # page_size: whole pages are planned one entry per page, as the host pools and the plugin plan them.
        return lambda: direct.copy_rows(copy_pairs, dst_idx, src_idx, mode=mode, page_size=page_size)
    if provider == "torch-index":
        if to_device:
            def call():
                for host, dev in pairs:
                    dev[dev_cuda] = host[host_idx].to("cuda", non_blocking=True)
        else:
            def call():
                for host, dev in pairs:
                    host[host_idx] = dev[dev_cuda].to("cpu")
        return call
    if provider == "per-page":
        starts = list(zip(host_idx[::page_size].tolist(), dev_idx[::page_size].tolist()))
        if to_device:
            def call():
                for host, dev in pairs:
                    for h, d in starts:
                        dev[d:d + page_size].copy_(host[h:h + page_size], non_blocking=True)
        else:
            def call():
                for host, dev in pairs:
                    for h, d in starts:
                        host[h:h + page_size].copy_(dev[d:d + page_size], non_blocking=True)
        return call
    raise ValueError(f"unknown provider {provider!r}")


def _parse_jit_provider(name: str):
    """'jit[-plain|-bulk|-resident][-qN][-rR][-wW][-aA]': method, CTAs, resident CTAs (R, for
    'resident') and bulk tuning (warps, read alignment)."""
    method, quota, tuning = None, None, {}
    for part in name.split("-")[1:]:
        if part in ("plain", "bulk", "resident"):
            method = part if method is None else f"{method}-{part}"  # e.g. jit-resident-bulk
        elif part[0] == "r" and part[1:].isdigit():
            tuning["resident_blocks"] = int(part[1:])
        elif part[0] == "q":
            quota = int(part[1:])
        elif part[0] == "w":
            tuning["bulk_warps"] = int(part[1:])
        elif part[0] == "a":
            tuning["read_align"] = int(part[1:])
        else:
            raise ValueError(f"unknown provider part {part!r} in {name!r}")
    return method, quota, tuning


def _resident_blocks(ops, blocks) -> None:
    """Resident CTAs for the next resident transfer: the queue is made again when the count changes."""
    import os

    from .. import settings

    wanted = str(blocks) if blocks else ""
    if os.environ.get(settings.RESIDENT_BLOCKS, "") != wanted:
        ops.stop_resident()
        if wanted:
            os.environ[settings.RESIDENT_BLOCKS] = wanted
        else:
            os.environ.pop(settings.RESIDENT_BLOCKS, None)


def _jit_call(ops, pools, scope, to_device, host_views, dev_views, host_cuda, dev_cuda, quota, method):
    if scope == "all":
        host_tab = ops.LayerTable(_table_arg([[buf[:, l] for l in range(LAYERS)] for buf in pools.host]),
                                  written=not to_device)
        dev_tab = ops.LayerTable(_table_arg(pools.device), written=to_device)
        if to_device:
            return lambda: ops.transfer_all_layer(dev_tab, dev_cuda, host_tab, host_cuda, block_quota=quota, method=method)
        return lambda: ops.transfer_all_layer(host_tab, host_cuda, dev_tab, dev_cuda, block_quota=quota, method=method)
    if pools.caches == 1:
        if to_device:
            return lambda: ops.transfer_one_layer_mla(dev_views[0], dev_cuda, host_views[0], host_cuda,
                                                      block_quota=quota, method=method)
        return lambda: ops.transfer_one_layer_mla(host_views[0], host_cuda, dev_views[0], dev_cuda,
                                                  block_quota=quota, method=method)
    if to_device:
        return lambda: ops.transfer_one_layer(dev_views[0], dev_views[1], dev_cuda, host_views[0], host_views[1],
                                              host_cuda, block_quota=quota, method=method)
    return lambda: ops.transfer_one_layer(host_views[0], host_views[1], host_cuda, dev_views[0], dev_views[1],
                                          dev_cuda, block_quota=quota, method=method)


def _table_arg(groups):
    return groups[0] if len(groups) == 1 else (tuple(groups[0]), tuple(groups[1]))
