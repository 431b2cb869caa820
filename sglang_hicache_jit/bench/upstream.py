"""Upstream SGLang's HiCache kernels as benchmark providers, so every run can put them beside ours.

Provider names: ``upstream`` (SGLang's dispatcher picks its register or TMA kernel, as its host pool
asks it, page size included), ``upstream-reg`` (its register kernel), ``upstream-tma`` (its TMA bulk
kernel); a ``-qN`` suffix passes ``block_quota=N`` (CTAs), otherwise each kernel runs at SGLang's own
default. Every call goes through SGLang's public functions in ``sglang.kernels.ops.kvcache.hicache``;
nothing of SGLang is copied here. A provider that cannot run (SGLang not importable, its kernel not
built, rows it does not take) raises :class:`Unavailable` with the reason, and the benchmark skips it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging

MODULE = "sglang.kernels.ops.kvcache.hicache"
KERNELS = ("reg", "tma")
FUNCTIONS = ("transfer_hicache_one_layer", "transfer_hicache_one_layer_mla", "transfer_hicache_all_layer",
             "transfer_hicache_all_layer_mla")


class Unavailable(Exception):
    """A provider that cannot run here; the benchmark prints the reason and goes on without it."""


def parse(name: str) -> tuple[str | None, int | None]:
    """'upstream[-reg|-tma][-qN]' -> (kernel, CTAs); None: the dispatcher's choice, SGLang's default CTAs."""
    parts = name.split("-")
    if parts[0] != "upstream":
        raise ValueError(f"not an upstream provider: {name!r}")
    kernel, quota = None, None
    for part in parts[1:]:
        if part in KERNELS and kernel is None:
            kernel = part
        elif part[:1] == "q" and part[1:].isdigit() and int(part[1:]) > 0 and quota is None:
            quota = int(part[1:])
        else:
            raise ValueError(f"unknown provider part {part!r} in {name!r} (expected upstream[-reg|-tma][-qN])")
    return kernel, quota


@functools.lru_cache(maxsize=None)
def _load():
    try:
        return importlib.import_module(MODULE), None
    except Exception as exc:  # not installed, or its import chain breaks (a missing dependency)
        return None, f"{type(exc).__name__}: {exc}"


def importable() -> bool:
    return _load()[0] is not None


def module():
    """SGLang's HiCache kernel module, or Unavailable saying why not."""
    up, error = _load()
    if up is None:
        raise Unavailable(f"SGLang's HiCache kernels ({MODULE}) are not importable: {error}")
    replaced = [name for name in FUNCTIONS if getattr(getattr(up, name, None), "__module__", None) != MODULE]
    if replaced:  # e.g. this package's SGLang plugin routed them here: the figures would not be upstream's
        raise Unavailable(f"{', '.join(replaced)} in {MODULE} are missing or not SGLang's own in this process")
    return up


def _forced(up, use_tma: bool, call):
    """``call`` with SGLang's kernel choice fixed to the TMA (True) or the register (False) kernel.

    SGLang's transfer functions ask the module-level ``use_hicache_tma_kernel()`` which kernel to run.
    Its answer is cached per row size, CTAs and page size, so its environment switch
    (SGLANG_HICACHE_TMA_TRANSFER) cannot be flipped per call; standing in for it during the call
    names the kernel while still calling SGLang's public functions.
    """
    choose = lambda **_: use_tma  # noqa: E731

    def run():
        saved, up.use_hicache_tma_kernel = up.use_hicache_tma_kernel, choose
        try:
            call()
        finally:
            up.use_hicache_tma_kernel = saved
    return run


def _has_tma(up) -> bool:
    """Whether this release has the TMA kernel (0.5.16 and 0.5.17 have only the register kernel)."""
    return callable(getattr(up, "use_hicache_tma_kernel", None))


def _takes(function, name: str) -> bool:
    """Whether SGLang's ``function`` takes the keyword ``name`` (``page_size`` came in a later release)."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return True
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def prepare(up, kernel, row_bytes: int, quota, page_size: int) -> str:
    """Builds or loads the SGLang kernel a provider will run; returns 'reg' or 'tma', or raises Unavailable."""
    if not _has_tma(up):  # a release with the register kernel only: nothing to choose
        if kernel == "tma":
            raise Unavailable("this SGLang release has no TMA HiCache kernel (use_hicache_tma_kernel is missing)")
        try:
            ok = up.can_use_hicache_jit_kernel(element_size=row_bytes, block_quota=quota)
        except Exception as exc:
            raise Unavailable(f"SGLang's kernel cannot be built or loaded here: {type(exc).__name__}: {exc}") from exc
        if not ok:
            raise Unavailable(f"SGLang's register kernel does not take {row_bytes}-byte rows here, or did not "
                              "build (SGLang's warning above says which)")
        return "reg"
    tma_quota = quota or getattr(up, "TMA_BLOCK_QUOTA", None) or up.DEFAULT_BLOCK_QUOTA
    try:
        if kernel == "tma":
            if up.use_hicache_tma_kernel(element_size=row_bytes, block_quota=tma_quota, page_size=None):
                return "tma"
            raise Unavailable(f"SGLang's TMA kernel is off for {row_bytes}-byte rows here (it needs an sm90+ GPU, "
                              "rows a multiple of 16 bytes, SGLANG_HICACHE_TMA_TRANSFER not false, and a build "
                              "that loads)")
        if kernel == "reg":
            ok = []
            _forced(up, False, lambda: ok.append(up.can_use_hicache_jit_kernel(element_size=row_bytes,
                                                                                block_quota=quota)))()
            if ok[0]:
                return "reg"
            raise Unavailable(f"SGLang's register kernel does not take {row_bytes}-byte rows here, or did not "
                              "build (SGLang's warning above says which)")
        # the dispatcher, asked as SGLang's host pool asks it (page size included)
        if not up.can_use_hicache_jit_kernel(element_size=row_bytes, block_quota=quota, page_size=page_size):
            raise Unavailable(f"SGLang's dispatcher has no JIT kernel for {row_bytes}-byte rows at page size "
                              f"{page_size} (SGLang would fall back to its older sgl-kernel copy)")
        use_tma = up.use_hicache_tma_kernel(element_size=row_bytes, block_quota=tma_quota, page_size=page_size)
        return "tma" if use_tma else "reg"
    except Unavailable:
        raise
    except Exception as exc:  # no GPU, no tvm-ffi, a failed compile
        raise Unavailable(f"SGLang's kernel cannot be built or loaded here: {type(exc).__name__}: {exc}") from exc


@functools.lru_cache(maxsize=None)
def _note_compiles():
    logging.getLogger("sglang_hicache_jit").info(
        "upstream providers: SGLang compiles each of its kernels on first use (tvm-ffi); those points take longer")


def _pointer_table(tensors, device):
    import torch

    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64, device=device)


def build_call(up, provider: str, pools, scope: str, to_device: bool, layer: int, host_idx, dev_idx,
               page_size: int, layers: int):
    """A zero-argument callable doing one transfer through SGLang's kernel; ``.kernel`` says which ran.

    ``host_idx`` and ``dev_idx`` must be CUDA tensors on the pools' GPU: SGLang's kernels take GPU
    indices only, on both sides. The call is made once here, so a provider that fails on its first
    call is skipped (Unavailable) rather than ending the run.
    """
    kernel, quota = parse(provider)
    row_bytes = pools.row_bytes
    _note_compiles()
    picked = prepare(up, kernel, row_bytes, quota, page_size)
    kw = dict(block_quota=quota)
    if _takes(up.transfer_hicache_one_layer, "page_size"):
        kw["page_size"] = page_size
    idx_dst, idx_src = (dev_idx, host_idx) if to_device else (host_idx, dev_idx)
    if scope == "all":
        host = [_pointer_table([buf[:, l] for l in range(layers)], host_idx.device) for buf in pools.host]
        dev = [_pointer_table(per_layer, dev_idx.device) for per_layer in pools.device]
        # bytes from one slot to the next: page_first host rows hold every layer; device rows are packed
        host_stride, dev_stride = pools.host[0].stride(0) * pools.host[0].element_size(), row_bytes
        dst, src = (dev, host) if to_device else (host, dev)
        dst_stride, src_stride = (dev_stride, host_stride) if to_device else (host_stride, dev_stride)
        if pools.caches == 1:
            def call():
                up.transfer_hicache_all_layer_mla(dst[0], idx_dst, src[0], idx_src, cache_src_stride_bytes=src_stride,
                                                  cache_dst_stride_bytes=dst_stride, element_size=row_bytes, **kw)
        else:
            def call():
                up.transfer_hicache_all_layer(dst[0], dst[1], idx_dst, src[0], src[1], idx_src,
                                              kv_cache_src_stride_bytes=src_stride,
                                              kv_cache_dst_stride_bytes=dst_stride, element_size=row_bytes, **kw)
    else:
        host = [buf[:, layer] for buf in pools.host]
        dev = [per_layer[layer] for per_layer in pools.device]
        dst, src = (dev, host) if to_device else (host, dev)
        if pools.caches == 1:
            def call():
                up.transfer_hicache_one_layer_mla(dst[0], idx_dst, src[0], idx_src, element_dim=row_bytes, **kw)
        else:
            def call():
                up.transfer_hicache_one_layer(dst[0], dst[1], idx_dst, src[0], src[1], idx_src,
                                              element_dim=row_bytes, **kw)
    if kernel is not None and _has_tma(up):
        call = _forced(up, kernel == "tma", call)
    try:
        call()
    except Exception as exc:
        raise Unavailable(f"its first call failed: {type(exc).__name__}: {str(exc)[:300]}") from exc
    call.kernel = picked
    return call
