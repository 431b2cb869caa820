"""The ``sglang-hicache-jit`` command (also ``python -m sglang_hicache_jit``).

Why one long module: one short function per subcommand plus the parser that names them all; each
command imports its work lazily, so --help stays fast.

Arguments are parsed before anything heavy is imported (torch takes seconds),
so ``--help`` and bad arguments answer at once. Every ``--json`` output is one
JSON object with ``"schema": 1`` and the same keys whatever happened;
docs/cli.md describes each. Expected failures (a missing toolkit, a bad
setting, a refused bundle) end as ``error: ...`` and ``fix: ...`` lines and a
non-zero exit, never as a traceback (``-v`` shows the traceback). Anything
else is a bug, and its traceback is for the report.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import sys
import warnings

from . import __version__, settings
from .errors import BadSettingError, CacheWriteError, HicacheJitError, NoArchError

SCHEMA = 1


def _print_json(document: dict) -> None:
    print(json.dumps({"schema": SCHEMA, **document}, indent=2))


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _bad_option(option: str, value, exc: ValueError, fix: str) -> BadSettingError:
    # A ValueError from parsing an option is the user's input, not a bug: report it like a bad setting.
    return BadSettingError(f"{option} {settings.shown(value)}: {exc}.", fix)


def _archs_from(text: str | None):
    """--arch LIST: each arch separately. Without it: what load_kernels() would load."""
    from .buildcache.arch import parse_arch_list, resolve_archs

    if text:
        try:
            return [(a,) for a in parse_arch_list(text)]
        except ValueError as exc:
            raise _bad_option("--arch", text, exc, "name archs like '9.0' or '8.0;9.0;10.0'.") from None
    archs, _ = resolve_archs(None)
    return [archs]


def _label(archs) -> str:
    return ";".join(str(a) for a in archs)


# ---- commands ----------------------------------------------------------------

def cmd_prewarm(args) -> int:
    from .buildcache.loader import ensure_built

    records = []
    for archs in _archs_from(args.arch):
        record = {"kernel": "hicache_transfer", "arch": _label(archs), "action": "failed", "seconds": 0.0,
                  "path": None, "code": "ok", "error": None}
        try:
            result = ensure_built(archs, retry_failed=True)
            record.update(action=result.action, seconds=round(result.seconds, 3), path=str(result.path))
        except (BadSettingError, CacheWriteError):
            raise  # the same for every target: one `error:` line from run_command()
        except HicacheJitError as exc:
            record.update(path=exc.log_path, code=exc.code, error=str(exc))
        records.append(record)
        if args.json:
            continue
        if record["action"] == "failed":
            print(f"{record['kernel']}  {record['arch']:<10} failed [{record['code']}]: {record['error']}")
        else:
            print(f"{record['kernel']}  {record['arch']:<10} {record['action']:<8} "
                  f"{record['seconds']:6.1f} s  {record['path']}")
    ok = all(r["action"] != "failed" for r in records)
    if args.json:
        _print_json({"ok": ok, "results": records})
    return 0 if ok else 1


def _check_record(arch=None, device=None, code="ok", reason="", fix="", library=None, method=None) -> dict:
    # One shape for both kinds of check, so a script reads results[i]["code"] either way.
    return {"arch": arch, "device": device, "ok": code == "ok", "code": code, "reason": reason, "fix": fix or "",
            "library": library, "method": method}


def _check_gpu(args) -> list[dict]:
    from .transfer.probe import probe

    r = probe(device=args.device, build=not args.no_build)
    return [_check_record(r.capability, r.device, r.code, r.reason, r.fix, r.library, r.method)]


def _check_archs(args) -> list[dict]:
    from .buildcache.loader import load_archs

    records = []
    for archs in _archs_from(args.arch):
        try:
            # As load_kernels does: an entry removed between the look and the load (a clean racing
            # this check) is looked for again, and is then "not built", not a corrupt entry.
            library = load_archs(archs, build=not args.no_build)
            records.append(_check_record(_label(archs), reason=f"built and loadable: {library.path}",
                                         library=str(library.path)))
        except (BadSettingError, CacheWriteError):
            raise  # the same for every target: one `error:` line from run_command()
        except HicacheJitError as exc:
            records.append(_check_record(_label(archs), code=exc.code, reason=exc.reason, fix=exc.fix))
        except Exception as exc:  # a library that fails to load
            records.append(_check_record(_label(archs), code="load_failed", reason=f"{type(exc).__name__}: {exc}"))
    return records


def cmd_check(args) -> int:
    records = _check_archs(args) if args.arch else _check_gpu(args)
    ok = all(r["ok"] for r in records)
    if args.json:
        _print_json({"ok": ok, "results": records})
        return 0 if ok else 1
    for r in records:
        prefix = f"{r['arch']:<10} " if args.arch else ""
        print(f"{prefix}{r['code']}: {r['reason']}")
        if r["fix"]:
            print(f"{' ' * len(prefix)}fix: {r['fix']}")
    return 0 if ok else 1


def _layer_record(kind: str, location: str, cache=None) -> dict:
    record = {"kind": kind, "location": location, "entries": None, "failed_builds": None, "error": None}
    if cache is None:
        return record  # a remote layer: listing it would reach the network
    try:
        record["entries"] = [
            {"path": str(path), "valid": entry is not None, "problem": problem or None,
             "archs": entry.manifest["components"]["archs"] if entry else None,
             "key": entry.key if entry else None, "size": entry.manifest["size"] if entry else None,
             "built_at": entry.manifest.get("built_at") if entry else None,
             "build_seconds": entry.manifest.get("build_seconds") if entry else None}
            for path, entry, problem in cache.entries()]
        record["failed_builds"] = [str(p) for p in cache.failures()]
    except OSError as exc:
        record["error"] = str(exc)
    return record


def _target() -> dict:
    """What load_kernels() would load here, and where it would come from without building."""
    from .buildcache.arch import resolve_archs
    from .buildcache.doctor import where_available
    from .buildcache.toolchain import find_toolkit

    try:
        archs, source = resolve_archs(None)
    except (HicacheJitError, ValueError) as exc:
        return {"archs": None, "source": None, "available_from": None,
                "note": f"{getattr(exc, 'reason', exc)} Name one with {settings.ARCH} (e.g. 9.0)."}
    return {"archs": _label(archs), "source": source, "available_from": where_available(archs, find_toolkit()),
            "note": None}


def _info() -> dict:
    from pathlib import Path

    from .buildcache import remote
    from .buildcache.cache import BuildCache
    from .buildcache.toolchain import find_ninja, find_toolkit, torch_info

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
    info["settings"] = _with_arch_errors(settings.effective())
    # In the loader's order: local prebuilt layers, the writable cache, then remote layers.
    prebuilt = settings.prebuilt_dirs()
    layers = [_layer_record("prebuilt", p, BuildCache(Path(p), prebuilt=True))
              for p in prebuilt if not remote.is_url(p)]
    layers.append(_layer_record("cache", str(settings.cache_root()), BuildCache(settings.cache_root())))
    layers += [_layer_record("remote", p) for p in prebuilt if remote.is_url(p)]
    info["layers"] = layers
    info["target"] = _target()
    from .integrations.sglang import describe

    info["sglang_plugin"] = describe()  # a switch that is neither on nor off: its line says so
    return info


def _with_arch_errors(records: list) -> list:
    """settings.effective() cannot parse arch lists (settings imports no subpackage): an arch variable that
    names no arch is marked invalid here, so `info` does not show SGLANG_HICACHE_JIT_ARCH=sm_999 as usable."""
    from .buildcache.arch import parse_arch_list

    for record in records:
        value = record["value"]
        if record["variable"] not in (settings.ARCH, settings.TORCH_ARCH_LIST) or not value or record["error"]:
            continue
        if record["variable"] == settings.TORCH_ARCH_LIST and value.lower() == "native":
            continue
        try:
            parse_arch_list(value)
        except ValueError as exc:
            record["error"] = str(settings.bad(record["variable"], value, str(exc)))
    return records


def _format_setting(s: dict) -> str:
    if s.get("retired"):
        return s["retired"]
    if s["error"]:
        return f"INVALID: {s['error']}"
    value = s["value"]
    if value is None or value == []:
        return f"{s['default']}  (default)"
    if isinstance(value, bool):
        value = "on" if value else "off"
    elif isinstance(value, list):  # layers (paths) or trusted owners (uids)
        value = ":".join(map(str, value))
    return f"{value}  ({s['source']})"


def cmd_info(args) -> int:
    info = _info()
    if args.json:
        _print_json(info)
        return 0
    torch = info["torch"]
    print(f"sglang-hicache-jit {info['package']}  (Python {info['python']})")
    print(f"torch         {torch.get('version', torch.get('error'))}  CUDA {torch.get('cuda')}")
    tk = info["cuda_toolkit"]
    print(f"CUDA toolkit  {tk['home']} (CUDA {tk['version']}, found by {tk['found_by']})" if tk else
          "CUDA toolkit  not found (set CUDA_HOME to build; loading prebuilt entries needs none)")
    print(f"ninja         {info['ninja'] or 'not found (pip install ninja)'}")
    print("settings (env: set in the environment; default: not set)")
    for s in info["settings"]:
        print(f"  {s['variable']:<34} {_format_setting(s)}")
    print("layers, searched in this order")
    for layer in info["layers"]:
        print(f"  {layer['kind']:<8} {layer['location']}")
        if layer["error"]:
            print(f"           unreadable: {layer['error']}")
        elif layer["entries"] is None:
            print("           (remote: not listed; `doctor` checks that it is reachable)")
        else:
            if not layer["entries"]:
                print("           no entries")
            for e in layer["entries"]:
                if e["valid"]:
                    print(f"           {';'.join(e['archs']):<10} {e['key']}  {e['size'] / 1e6:.1f} MB  "
                          f"built {e['built_at']} in {e['build_seconds']} s")
                else:
                    print(f"           INVALID {e['path']}: {e['problem']}")
            for f in layer["failed_builds"]:
                print(f"           failed build: {f}")
    target = info["target"]
    if target["archs"] is None:
        print(f"this machine  no arch to load: {target['note']}")
    else:
        where = target["available_from"] or "nowhere yet (the first use builds it)"
        print(f"this machine  loads {target['archs']} (from {target['source']}): {where}")
    print(f"SGLang plugin {info['sglang_plugin']['line']}")
    return 0


def _progress(line: str) -> None:
    print(f"demo {line}", file=sys.stderr, flush=True)  # stderr: --json keeps stdout for the document


def cmd_demo(args) -> int:
    tokens = settings.whole_number(args.tokens.strip(), 1, 1 << 62)
    fix = "pass a positive multiple of 64 that fits in memory, e.g. --tokens 16384."
    if tokens is None or tokens % 64:
        raise _bad_option("--tokens", args.tokens if tokens is None else tokens,
                          ValueError("it must be a positive multiple of 64, written with the digits 0-9"), fix)
    from .bench.demo import check_tokens, format_report, run_demo

    try:
        check_tokens(tokens)  # the size against free memory, before anything is allocated
    except BadSettingError:
        raise  # SGLANG_HICACHE_JIT_STAGING, not --tokens: it names itself
    except ValueError as exc:
        raise _bad_option("--tokens", tokens, exc, fix) from None
    try:
        report = run_demo(tokens, progress=None if args.quiet else _progress)
    except RuntimeError as exc:  # memory taken by someone else since the check: torch's allocators say so
        if "out of memory" not in str(exc) and "can't allocate memory" not in str(exc):
            raise
        raise BadSettingError(f"--tokens {tokens}: the demo ran out of memory ({str(exc).splitlines()[0][:200]}).",
                              "pass a smaller --tokens, or free memory.") from None
    ok = all(r["bit_exact"] for r in report["results"])
    if args.json:
        _print_json({"ok": ok, **report})
    else:
        print(format_report(report))
    return 0 if ok else 1


def cmd_clean(args) -> int:
    from .buildcache.cache import BuildCache
    from .buildcache.prune import clean

    root = settings.cache_root()
    report = clean(BuildCache(root), failed_only=args.failed)  # removes only what no live process is using
    reasons = [why for _, why, _ in report.removed]
    entries, failed = reasons.count("removed by clean"), reasons.count("failed-build record")
    leftovers = len(reasons) - entries - failed  # staging of dead builders, half-deleted entries
    if args.json:
        _print_json({"root": str(root), "entries": entries, "failed_builds": failed, "leftovers": leftovers,
                     "skipped_locked": [str(p) for p in report.skipped_locked]})
        return 0
    for path in report.skipped_locked:
        print(f"kept    {path}: another process is building or importing it")
    if args.failed:
        print(f"forgot {_plural(failed, 'failed build', 'failed builds')} under {root}; the next use retries "
              f"{'it' if failed == 1 else 'them'}")
    else:
        print(f"removed {_plural(entries, 'cache entry', 'cache entries')}, "
              f"{_plural(failed, 'failed-build record', 'failed-build records')} and "
              f"{_plural(leftovers, 'leftover build directory', 'leftover build directories')} from {root}")
    return 0


def _print_bundle(report, args, into: str | None = None) -> None:
    if args.json:
        _print_json({"bundle": report.path, "into": into, "entries": report.entries, "notes": report.notes})
        return
    for e in report.entries:
        print(f"hicache_transfer  {e['arch']:<10} {e['action']:<8} {e['path']}")
    for note in report.notes:
        print(f"note: {note}")
    actions = [e["action"] for e in report.entries]
    if args.command == "export":
        print(f"exported {_plural(len(actions), 'entry', 'entries')} to {report.path}")
    else:
        imported, kept = actions.count("imported"), actions.count("kept")
        print(f"imported {_plural(imported, 'entry', 'entries')} and kept {kept} already present, "
              f"into {into or settings.cache_root()} from {report.path}")


def cmd_export(args) -> int:
    from .buildcache.bundle import export_bundle

    _print_bundle(export_bundle(_archs_from(args.arch), args.output), args)
    return 0


def cmd_import(args) -> int:
    from .buildcache.bundle import import_bundle

    _print_bundle(import_bundle(args.bundle, into=args.into), args, into=args.into)
    return 0


def cmd_prune(args) -> int:
    from .buildcache.cache import BuildCache
    from .buildcache.prune import prune

    try:
        max_size = settings.parse_size(args.max_size) if args.max_size is not None else settings.cache_max_size()
    except BadSettingError:
        raise
    except ValueError as exc:
        raise _bad_option("--max-size", args.max_size, exc, "write it like 500M, 10G or 1.5T.") from None
    report = prune(BuildCache(settings.cache_root()), max_size=max_size, older_than_days=args.older_than)
    if args.json:
        _print_json({"removed": [{"path": str(p), "reason": why, "bytes": size} for p, why, size in report.removed],
                     "skipped_locked": [str(p) for p in report.skipped_locked],
                     "bytes_before": report.total_before, "bytes_after": report.total_after})
        return 0
    for path, why, size in report.removed:
        print(f"removed {path} ({size / 1e6:.1f} MB): {why}")
    for path in report.skipped_locked:
        print(f"kept    {path}: another process is building or importing it")
    print(f"{len(report.removed)} removed, {report.freed / 1e6:.1f} MB freed; entries now "
          f"{report.total_after / 1e6:.1f} MB under {settings.cache_root()}")
    return 0


def cmd_doctor(args) -> int:
    from .buildcache.doctor import as_json, format_checks, run_checks

    checks = run_checks(args.arch)
    result = as_json(checks)  # carries the schema itself: it is also doctor's Python API
    print(json.dumps(result, indent=2) if args.json else format_checks(checks))
    return 0 if result["ok"] else 1


def cmd_bench(args) -> int:
    from .bench.command import run_parsed

    return run_parsed(args)


# ---- parsing -----------------------------------------------------------------

def _add_verbosity(parser: argparse.ArgumentParser, default) -> None:
    # On the main parser and on every command, so -q and -v work before or after the command. The commands'
    # copies default to SUPPRESS: otherwise a command's default would undo a -q given before it.
    parser.add_argument("-q", "--quiet", action="store_true", default=default,
                        help="log warnings only (bench: no row per measurement)")
    parser.add_argument("-v", "--verbose", action="store_true", default=default,
                        help="log debug messages; show a traceback on errors")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-hicache-jit",
        description="HiCache KV transfer kernels for SGLang: build cache, checks and tools.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_verbosity(parser, False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, func, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        _add_verbosity(p, argparse.SUPPRESS)
        p.set_defaults(func=func)
        return p

    def json_flag(p, what="print the result as JSON (see docs/cli.md)"):
        p.add_argument("--json", action="store_true", help=what)

    arch_help = ("arch list, e.g. '9.0' or '8.0;9.0;10.0' (each built separately). Default: "
                 f"${settings.ARCH}, then ${settings.TORCH_ARCH_LIST} (one fat build), then the current GPU")
    p = command("prewarm", cmd_prewarm, "build the kernels into the cache ahead of time (no GPU needed with --arch)")
    p.add_argument("--arch", help=arch_help)
    json_flag(p)

    p = command("check", cmd_check, "exit 0 when the one-layer kernel is available (for CI)")
    p.add_argument("--arch", help="check that these archs are built and loadable instead of probing the GPU")
    p.add_argument("--no-build", action="store_true", help="only look in the cache, never compile")
    p.add_argument("--device", type=settings.whole_number_option, default=None, help="CUDA device to probe (default: current)")
    json_flag(p)

    p = command("info", cmd_info, "versions, toolchain, every setting and where it came from, layers and entries")
    json_flag(p)

    from .bench.command import add_arguments  # argparse only: torch is imported when the benchmark runs

    p = command("bench", cmd_bench, "benchmark the transfers on this GPU against PyTorch baselines and the "
                "link's ceiling")
    add_arguments(p)

    p = command("demo", cmd_demo, "DeepSeek-V3-shaped HiCache backup/load through the probe's path and the "
                "direct path: bit-exact checks and GB/s against the ceiling")
    p.add_argument("--tokens", default="16384",
                   help="tokens per transfer, a multiple of 64 (default 16384); the pools must fit in free memory")
    json_flag(p)

    p = command("clean", cmd_clean, "remove cache entries (or only failed-build records)")
    p.add_argument("--failed", action="store_true", help="only forget failed builds, so they are retried")
    json_flag(p)

    p = command("export", cmd_export, "pack the built kernels for some archs into a bundle (building missing ones)")
    p.add_argument("--arch", required=True, help="arch list, e.g. '9.0' or '8.0;9.0;10.0' (each built separately)")
    p.add_argument("-o", "--output", required=True, help="bundle file (.tar.gz) or fsspec URL to write")
    json_flag(p)

    p = command("import", cmd_import, "verify a bundle and add its entries to the cache (or to a prebuilt layer)")
    p.add_argument("bundle", help="bundle file (.tar.gz) or fsspec URL")
    p.add_argument("--into", help="directory to import into, e.g. a future prebuilt layer (default: the cache)")
    json_flag(p)

    p = command("prune", cmd_prune, "remove least recently used and stale entries, failed-build records, debris")
    p.add_argument("--max-size", help=f"keep the entries under this size, e.g. 500M or 10G (default: "
                                      f"${settings.CACHE_MAX_SIZE}, else no size limit)")
    p.add_argument("--older-than", type=settings.decimal_option, metavar="DAYS", help="remove entries not loaded for DAYS days")
    json_flag(p)

    p = command("doctor", cmd_doctor, "check nvcc, ninja, the host compiler, versions, archs, the cache and the "
                "prebuilt layers; print a fix for each problem (exit 1 when there is one)")
    p.add_argument("--arch", help="archs to check (default: what load_kernels() would load here)")
    json_flag(p)
    return parser


# ---- running -----------------------------------------------------------------

def _quiet_numpy_warning() -> None:
    # torch warns "Failed to initialize NumPy" at import when numpy is absent. Nothing here uses numpy,
    # so that warning would only be the first (and misleading) line a new user sees.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)


def run_command(args) -> int:
    """Runs the parsed command. An expected failure (expected_error) becomes one `error:` line on stderr
    and exit 1, or 2 when the input is at fault (a bad setting or option, or no arch named where one is
    needed); with --verbose the traceback follows instead. Anything else propagates: a bug."""
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (HicacheJitError, OSError) as exc:
        message = expected_error(exc)
        if message is None or getattr(args, "verbose", False):
            raise
        print(message, file=sys.stderr)
        return 2 if isinstance(exc, (BadSettingError, NoArchError)) else 1


# OSErrors that come from the environment (permissions, a full or read-only
# disk, a path that is not what it should be), not from a bug in this package.
_ENVIRONMENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOENT,
                       errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP, errno.EBUSY, errno.EIO,
                       errno.ENOTEMPTY, errno.EEXIST, errno.EXDEV, errno.EMFILE, errno.ENFILE}


def expected_error(exc: BaseException) -> str | None:
    """The one line `error: [code] reason (fix: ...)` for an expected error (HicacheJitError, or an
    OSError caused by the environment); None for anything else (a bug). A build failure's reason
    carries the compiler's last lines: only its first line is shown, the fix names the log."""
    if isinstance(exc, HicacheJitError):
        reason = " ".join(exc.reason.strip().splitlines()[:1]) or exc.code
        return f"error: [{exc.code}] {reason}" + (f" (fix: {exc.fix})" if exc.fix else "")
    if isinstance(exc, OSError) and exc.errno in _ENVIRONMENT_ERRNOS:
        where = f": {exc.filename}" if exc.filename else ""
        return (f"error: {exc.strerror or exc}{where} (fix: check that the path exists and that this user may "
                "read and write it, and that the disk has space)")
    return None


def main(argv: list[str] | None = None) -> int:
    _quiet_numpy_warning()
    for stream in (sys.stdout, sys.stderr):
        # A path or variable with non-UTF-8 bytes (a lone surrogate in Python) is printed escaped,
        # never as a UnicodeEncodeError in the middle of a report.
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
