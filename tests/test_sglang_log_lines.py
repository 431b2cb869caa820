"""What the plugin says in a server's log is there and true (issue 29).

* The start line (``sglang-hicache-jit: sglang X (...): routing N HiCache ops ...``): SGLang runs plugins
  before it configures logging, in the engine and in each scheduler, so a line logged from
  ``register()`` was dropped. It is now kept until the first host pool is built (``announce.py``).
* The per-pool line names what runs for each io_backend: ``direct`` always uses the copy engines.

The unit tests need nothing but this package; the ones against SGLang's own pool classes run a child
process (the plugin patches process-wide state) as SGLang's scheduler does it: plugins first, logging
second, then the pools.
"""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_start_line_waits_until_logging_shows_it():
    from sglang_hicache_jit.integrations.sglang import announce

    logger = logging.getLogger("sglang_hicache_jit.test_announce")
    logger.propagate = False
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    try:
        logger.setLevel(logging.WARNING)  # as before SGLang configures logging: INFO is not shown
        assert announce.start_line(logger, "start %s", "line") is False and announce.pending()
        assert records == []
        handler = Keep()
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)  # SGLang configured logging
        announce.flush()
        announce.flush()  # once only
        assert records == ["start line"] and not announce.pending()
        assert announce.start_line(logger, "again") is True  # configured already: logged at once
        assert records == ["start line", "again"]
    finally:
        logger.handlers.clear()
        announce._pending.clear()


@pytest.mark.parametrize("layout, path, expected", [
    ("page_first", "kernel", "the JIT kernel with io_backend=kernel, the copy engines with io_backend=direct"),
    ("layer_first", "kernel", "the JIT kernel with io_backend=kernel, the copy engines with io_backend=direct"),
    ("page_first_direct", "kernel", "the copy engines with either io_backend (page_first_direct moves whole pages)"),
    ("page_first", "direct", "the copy engines with either io_backend (the JIT kernel is not used for these rows)"),
])
def test_pool_line_names_the_path_of_each_io_backend(layout, path, expected):
    from sglang_hicache_jit.integrations.sglang.pools import paths_by_backend

    assert paths_by_backend(layout, path) == expected
    assert paths_by_backend(layout, path, 1 << 20) == expected  # copies of 1 MiB: as without a size


@pytest.mark.parametrize("layout, expected", [
    ("page_first", "the JIT kernel with io_backend=kernel, the JIT kernel at 1 CTA (1152-B copies) with "
                   "io_backend=direct"),
    ("page_first_direct", "the JIT kernel at 1 CTA (1152-B copies) with either io_backend (page_first_direct "
                          "moves whole pages)"),
])
def test_pool_line_names_the_one_cta_kernel_for_small_direct_copies(layout, expected):
    from sglang_hicache_jit.integrations.sglang.pools import _direct_copy_bytes, paths_by_backend

    pool = type("Pool", (), {"page_size": 1})()
    assert paths_by_backend(layout, "kernel", _direct_copy_bytes(pool, layout, 1152)) == expected
    assert _direct_copy_bytes(type("Pool", (), {"page_size": 64})(), "layer_first", 1152) == 64 * 1152
    assert _direct_copy_bytes(type("Pool", (), {"page_size": 64})(), "page_first", 1152) == 1152


# ---------------------------------------------------------------------------
# Against SGLang's own pool classes, in a child process as SGLang's scheduler runs.

_CHILD = """
import logging, sys
import torch
from release_kit import tolerate_newer_transformers
tolerate_newer_transformers()
configure_first, force_kernel, layout = sys.argv[1] == "1", sys.argv[2] == "1", sys.argv[3]
fmt = "%(levelname)s %(name)s: %(message)s"
if configure_first:
    logging.basicConfig(level=logging.INFO, format=fmt, force=True)
from sglang.srt.plugins import load_plugins
load_plugins()
logging.basicConfig(level=logging.INFO, format=fmt, force=True)  # what SGLang's configure_logger does
print("MARK logging configured", file=sys.stderr, flush=True)
from sglang_hicache_jit.integrations.sglang import ops as routed
if force_kernel:
    from sglang_hicache_jit.transfer import route
    route._verdicts[1152] = True  # as on a GPU where the probe said ok
import sglang_cells
for _ in range(2):
    built = sglang_cells.mla_pool(layout=layout, sharded=False, dtype=torch.bfloat16, dim=576, device="cpu", pin=False)
    sglang_cells.release(built.host)
"""


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    try:
        import sglang.srt.mem_cache.pool_host.mla  # noqa: F401
    except Exception as exc:  # ImportError, or a missing dependency of sglang's import chain
        if os.environ.get("SGLANG_HICACHE_JIT_REQUIRE_SGLANG") == "1":
            pytest.fail(f"sglang is required here (SGLANG_HICACHE_JIT_REQUIRE_SGLANG=1) but does not import: {exc}")
        pytest.skip(f"needs sglang (pip install -e \".[test,sglang]\" && pip install --no-deps sglang==0.5.23): {exc}")
    from importlib.metadata import version

    import release_kit

    return release_kit.write_standin(tmp_path_factory.mktemp("standin"), version("sglang"))


def _child(standin, configure_first: bool, force_kernel: bool, layout: str) -> list:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(standin), str(HERE), str(HERE.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    env.pop("SGLANG_HICACHE_JIT_SGLANG_PLUGIN", None)
    env.pop("SGLANG_PLUGINS", None)
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(int(configure_first)), str(int(force_kernel)), layout],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr.splitlines()


def _index(lines, text):
    return [i for i, line in enumerate(lines) if text in line]


@pytest.mark.slow  # a fresh process importing sglang: ~15 s on 2 cores
def test_start_line_reaches_a_log_configured_after_the_plugins(standin):
    lines = _child(standin, configure_first=False, force_kernel=True, layout="page_first")
    start = _index(lines, "sglang-hicache-jit: sglang ")
    mark = _index(lines, "MARK logging configured")
    pools = _index(lines, "sglang-hicache-jit: MLATokenToKVPoolHost (layout=page_first, 1152 B rows)")
    assert len(start) == 1, "\n".join(lines[-40:])  # once per process, not once per pool
    assert mark[0] < start[0] < pools[0] and len(pools) == 2  # kept until the first pool, then shown
    assert "routing" in lines[start[0]] and lines[start[0]].startswith("INFO sglang_hicache_jit.plugin")
    assert lines[pools[0]].endswith("transfers through the JIT kernel with io_backend=kernel, the JIT kernel at 1 "
                                    "CTA (1152-B copies) with io_backend=direct")  # page_first: a row a copy


@pytest.mark.slow
def test_start_line_is_logged_at_once_where_logging_is_configured(standin):
    lines = _child(standin, configure_first=True, force_kernel=False, layout="page_first_direct")
    start = _index(lines, "sglang-hicache-jit: sglang ")
    mark = _index(lines, "MARK logging configured")
    assert len(start) == 1 and start[0] < mark[0]  # not held back where it would have been shown
    pools = _index(lines, "sglang-hicache-jit: MLATokenToKVPoolHost (layout=page_first_direct, 1152 B rows)")
    assert pools and lines[pools[0]].endswith("transfers through the copy engines with either io_backend (the JIT "
                                              "kernel is not used for these rows)")
