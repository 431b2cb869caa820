"""The ``sglang-hicache-jit`` command (also ``python -m sglang_hicache_jit``)."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import sys

from . import __version__, settings
from .errors import BadSettingError, CacheWriteError, HicacheJitError


def _archs_from(text: str | None):
    """--arch LIST: each arch separately. Without it: what load_kernels() would load."""
    from .arch import parse_arch_list, resolve_archs

    if text:
        return [(a,) for a in parse_arch_list(text)]
    archs, _ = resolve_archs(None)
    return [archs]


def _label(archs) -> str:
    return ";".join(str(a) for a in archs)


def cmd_prewarm(args) -> int:
    from .loader import ensure_built

    try:
        targets = _archs_from(args.arch)
    except (HicacheJitError, ValueError) as exc:
        print(expected_error(exc) or f"error: {exc}", file=sys.stderr)
        return 2
    records, failed = [], False
    for archs in targets:
        record = {"kernel": "hicache_transfer", "arch": _label(archs)}
        try:
            result = ensure_built(archs, retry_failed=True)
            record.update(action=result.action, seconds=round(result.seconds, 3), path=str(result.path))
        except (BadSettingError, CacheWriteError):
            raise  # the same for every target: one `error:` line from main()
        except HicacheJitError as exc:
            failed = True
            record.update(action="failed", seconds=0.0, path=exc.log_path, code=exc.code, error=str(exc))
        records.append(record)
        if not args.json:
            if record["action"] == "failed":
                print(f"{record['kernel']}  {record['arch']:<10} failed [{record['code']}]: {record['error']}")
            else:
                print(f"{record['kernel']}  {record['arch']:<10} {record['action']:<7} "
                      f"{record['seconds']:6.1f} s  {record['path']}")
    if args.json:
        print(json.dumps(records, indent=2))
    return 1 if failed else 0


def cmd_check(args) -> int:
    if not args.arch:
        from .probe import probe

        result = probe(device=args.device, build=not args.no_build)
        if args.json:
            print(json.dumps(result.as_dict(), indent=2))
        else:
            print(f"{result.code}: {result.reason}" + (f"\nfix: {result.fix}" if result.fix else ""))
        return 0 if result.available else 1

    from .loader import ensure_built, load_entry

    records, ok = [], True
    try:
        targets = _archs_from(args.arch)
    except ValueError as exc:
        print(expected_error(exc) or f"error: {exc}", file=sys.stderr)
        return 2
    for archs in targets:
        record = {"arch": _label(archs)}
        try:
            result = ensure_built(archs, build=not args.no_build)
            library = load_entry(result.entry, archs)
            record.update(code="ok", reason=f"built and loadable: {library.path}")
        except (BadSettingError, CacheWriteError):
            raise  # the same for every target: one `error:` line from main()
        except HicacheJitError as exc:
            ok = False
            record.update(code=exc.code, reason=exc.reason, fix=exc.fix)
        except Exception as exc:  # a library that fails to load
            ok = False
            record.update(code="load_failed", reason=f"{type(exc).__name__}: {exc}")
        records.append(record)
        if not args.json:
            print(f"{record['arch']:<10} {record['code']}: {record['reason']}"
                  + (f"\n           fix: {record['fix']}" if record.get("fix") else ""))
    if args.json:
        print(json.dumps(records, indent=2))
    return 0 if ok else 1


def _info() -> dict:
    from .cache import BuildCache
    from .toolchain import find_ninja, find_toolkit, torch_info

    info: dict = {"package": __version__, "python": sys.version.split()[0]}
    try:
        info["torch"] = torch_info()
    except HicacheJitError as exc:
        info["torch"] = {"error": exc.reason}
    toolkit = find_toolkit()
    info["cuda_toolkit"] = (
        {"home": str(toolkit.home), "version": toolkit.version, "found_by": toolkit.found_by}
        if toolkit else None
    )
    info["ninja"] = find_ninja()
    info["settings"] = {
        "cache_root": str(settings.cache_root()),
        "arch_request": settings.arch_request(),
        "disabled": settings.disabled(),
        "strict": settings.strict(),
    }
    cache = BuildCache(settings.cache_root())
    info["entries"] = [
        {"path": str(path), "valid": entry is not None, "problem": problem,
         **({"archs": entry.manifest["components"]["archs"], "key": entry.key, "size": entry.manifest["size"],
             "built_at": entry.manifest.get("built_at"), "build_seconds": entry.manifest.get("build_seconds")}
            if entry else {})}
        for path, entry, problem in cache.entries()
    ]
    info["failed_builds"] = [str(p) for p in cache.failures()]
    return info


def cmd_info(args) -> int:
    info = _info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    torch = info["torch"]
    print(f"sglang-hicache-jit {info['package']}  (Python {info['python']})")
    print(f"torch:        {torch.get('version', torch.get('error'))}  CUDA {torch.get('cuda')}")
    tk = info["cuda_toolkit"]
    print(f"CUDA toolkit: {tk['home']} (CUDA {tk['version']}, found by {tk['found_by']})" if tk else
          "CUDA toolkit: not found (set CUDA_HOME)")
    print(f"ninja:        {info['ninja'] or 'not found (pip install ninja)'}")
    s = info["settings"]
    print(f"cache root:   {s['cache_root']}")
    if s["arch_request"]:
        print(f"arch:         {s['arch_request'][0]} (from {s['arch_request'][1]})")
    if s["disabled"]:
        print(f"disabled:     yes ({settings.DISABLE}=1)")
    print(f"entries:      {len(info['entries'])}")
    for e in info["entries"]:
        if e["valid"]:
            print(f"  {';'.join(e['archs']):<10} {e['key']}  {e['size'] / 1e6:.1f} MB  built {e['built_at']}"
                  f" in {e['build_seconds']} s")
        else:
            print(f"  INVALID {e['path']}: {e['problem']}")
    for f in info["failed_builds"]:
        print(f"  failed build: {f}")
    return 0


def cmd_demo(args) -> int:
    from .demo import format_report, run_demo

    try:
        report = run_demo(args.tokens)
    except ValueError as exc:
        print(expected_error(exc) or f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if all(r["bit_exact"] for r in report["results"]) else 1


def cmd_clean(args) -> int:
    from .cache import BuildCache
    from .prune import clean

    report = clean(BuildCache(settings.cache_root()), failed_only=args.failed)
    for path in report.skipped_locked:
        print(f"kept    {path}: another process is building or importing it")
    what = "failed-build records" if args.failed else "cache entries, records and staging directories"
    print(f"removed {len(report.removed)} {what} under {settings.cache_root()}")
    return 0


def _print_bundle(report, args, verb: str) -> None:
    if args.json:
        print(json.dumps({"bundle": report.path, "entries": report.entries, "notes": report.notes}, indent=2))
        return
    for e in report.entries:
        print(f"hicache_transfer  {e['arch']:<10} {e['action']:<8} {e['path']}")
    for note in report.notes:
        print(f"note: {note}")
    print(f"{verb} {len(report.entries)} entries {'to' if verb == 'exported' else 'from'} {report.path}")


def cmd_export(args) -> int:
    from .bundle import export_bundle

    try:
        report = export_bundle(_archs_from(args.arch), args.output)
    except ValueError as exc:
        print(expected_error(exc) or f"error: {exc}", file=sys.stderr)
        return 2
    except HicacheJitError as exc:
        print(expected_error(exc), file=sys.stderr)
        return 1
    _print_bundle(report, args, "exported")
    return 0


def cmd_import(args) -> int:
    from .bundle import import_bundle

    try:
        report = import_bundle(args.bundle, into=args.into)
    except HicacheJitError as exc:
        print(expected_error(exc), file=sys.stderr)
        return 1
    _print_bundle(report, args, "imported")
    return 0


def cmd_prune(args) -> int:
    from .cache import BuildCache
    from .prune import prune

    try:
        max_size = settings.parse_size(args.max_size) if args.max_size is not None else settings.cache_max_size()
    except ValueError as exc:
        print(expected_error(exc) or f"error: {exc}", file=sys.stderr)
        return 2
    report = prune(BuildCache(settings.cache_root()), max_size=max_size, older_than_days=args.older_than)
    if args.json:
        print(json.dumps({"removed": [{"path": str(p), "reason": why, "bytes": size} for p, why, size in report.removed],
                          "skipped_locked": [str(p) for p in report.skipped_locked],
                          "bytes_before": report.total_before, "bytes_after": report.total_after}, indent=2))
        return 0
    for path, why, size in report.removed:
        print(f"removed {path} ({size / 1e6:.1f} MB): {why}")
    for path in report.skipped_locked:
        print(f"kept    {path}: another process is building or importing it")
    print(f"{len(report.removed)} removed, {report.freed / 1e6:.1f} MB freed; entries now "
          f"{report.total_after / 1e6:.1f} MB under {settings.cache_root()}")
    return 0


def cmd_doctor(args) -> int:
    from .doctor import as_json, format_checks, run_checks

    checks = run_checks(args.arch)
    result = as_json(checks)
    print(json.dumps(result, indent=2) if args.json else format_checks(checks))
    return 0 if result["ok"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-hicache-jit",
        description="HiCache KV transfer kernels for SGLang: build cache, checks and tools.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    sub = parser.add_subparsers(dest="command", required=True)

    arch_help = ("arch list, e.g. '9.0' or '8.0;9.0;10.0' (each built separately). Default: "
                 f"${settings.ARCH}, then ${settings.TORCH_ARCH_LIST} (one fat build), then the current GPU")
    p = sub.add_parser("prewarm", help="build the kernels into the cache ahead of time (no GPU needed with --arch)")
    p.add_argument("--arch", help=arch_help)
    p.add_argument("--json", action="store_true", help="print a JSON list of {kernel, arch, action, seconds, path}")
    p.set_defaults(func=cmd_prewarm)

    p = sub.add_parser("check", help="exit 0 when the one-layer kernel is available (for CI)")
    p.add_argument("--arch", help="check that these archs are built and loadable instead of probing the GPU")
    p.add_argument("--no-build", action="store_true", help="only look in the cache, never compile")
    p.add_argument("--device", type=int, default=None, help="CUDA device to probe (default: current)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("info", help="versions, toolchain, cache root and entries")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_info)

    # 'bench' is dispatched in main() straight to benchmark.py's own parser; listed here for --help.
    sub.add_parser("bench", help="benchmark the transfers on this GPU (`bench --help` for its options)")

    p = sub.add_parser("demo", help="DeepSeek-V3-shaped HiCache backup/load through the probe's path and the "
                       "direct path: bit-exact checks and GB/s against the ceiling")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per transfer, a multiple of 64 (default 16384)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("clean", help="remove cache entries (or only failed-build records)")
    p.add_argument("--failed", action="store_true", help="only forget failed builds, so they are retried")
    p.set_defaults(func=cmd_clean)

    p = sub.add_parser("export", help="pack the built kernels for some archs into a bundle (building missing ones)")
    p.add_argument("--arch", required=True, help="arch list, e.g. '9.0' or '8.0;9.0;10.0' (each built separately)")
    p.add_argument("-o", "--output", required=True, help="bundle file (.tar.gz) or fsspec URL to write")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", help="verify a bundle and add its entries to the cache (or to a prebuilt layer)")
    p.add_argument("bundle", help="bundle file (.tar.gz) or fsspec URL")
    p.add_argument("--into", help="directory to import into, e.g. a future prebuilt layer (default: the cache)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("prune", help="remove least recently used and stale entries, failed-build records, debris")
    p.add_argument("--max-size", help=f"keep the entries under this size, e.g. 500M or 10G (default: "
                                      f"${settings.CACHE_MAX_SIZE}, else no size limit)")
    p.add_argument("--older-than", type=float, metavar="DAYS", help="remove entries not loaded for DAYS days")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser("doctor", help="check nvcc, ninja, the host compiler, versions, archs, the cache and the "
                       "prebuilt layers; print a fix for each problem (exit 1 when there is one)")
    p.add_argument("--arch", help="archs to check (default: what load_kernels() would load here)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # everything after 'bench' belongs to the benchmark's own parser
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
        from .benchmark import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s",
                        stream=sys.stderr)
    try:
        return args.func(args)
    except (HicacheJitError, OSError) as exc:
        message = expected_error(exc)
        if message is None:
            raise  # a bug: the traceback is for the report
        print(message, file=sys.stderr)
        return 2 if isinstance(exc, BadSettingError) else 1


# OSErrors that come from the environment (permissions, a full or read-only
# disk, a path that is not what it should be), not from a bug in this package.
_ENVIRONMENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOENT,
                       errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP, errno.EBUSY, errno.EIO,
                       errno.ENOTEMPTY, errno.EEXIST, errno.EXDEV, errno.EMFILE, errno.ENFILE}


def expected_error(exc: BaseException) -> str | None:
    """The one line `error: ...` for an expected error (HicacheJitError, or an
    OSError caused by the environment); None for anything else (a bug)."""
    if isinstance(exc, HicacheJitError):
        reason = " ".join(exc.reason.strip().splitlines()[:1]) or exc.code
        return f"error: [{exc.code}] {reason}" + (f" (fix: {exc.fix})" if exc.fix else "")
    if isinstance(exc, OSError) and exc.errno in _ENVIRONMENT_ERRNOS:
        where = f": {exc.filename}" if exc.filename else ""
        return (f"error: {exc.strerror or exc}{where} (fix: check that the path exists and that this user may "
                "read and write it, and that the disk has space)")
    return None


if __name__ == "__main__":
    sys.exit(main())
