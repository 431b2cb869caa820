"""Shared test setup: markers that skip cleanly, and an isolated build cache.

* ``gpu`` tests need a CUDA GPU and are skipped without one.
* ``build`` tests run nvcc for a named arch (no GPU needed) and are skipped
  when no CUDA toolkit is installed.

* ``slow`` tests (a stress run, extra real builds) are left out of the
  default run by pyproject.toml; ``python3 -m pytest -q -m slow`` runs them.

Every test session gets its own cache root (SGLANG_HICACHE_JIT_CACHE_DIR), so
tests never touch a user's cache; one build of the kernels is shared by all
tests of the session. Nothing is written into the checkout, nor into the shared
temporary directory outside pytest's own base temp: hypothesis keeps its files
there (hypothesis_home), not in ./.hypothesis (pyproject.toml also turns off
pytest's cache and pytest-benchmark's .benchmarks).
"""

import os
import sys
from pathlib import Path

import pytest

# One CPU thread for torch, here and in every child a test starts (they inherit the environment): the
# tests' tensors are small, and on a 2-core machine whose cores are busy with other work, torch's
# OpenMP threads waiting for each other made tests/test_host_pool.py and test_bench_harness.py take
# 112 s instead of 42 s (two `yes` processes beside them). Read by torch at import, so set before it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _has_toolkit() -> bool:
    from sglang_hicache_jit.buildcache.toolchain import find_toolkit

    return find_toolkit() is not None


def pytest_collection_modifyitems(config, items):
    gpu, toolkit = _has_gpu(), _has_toolkit()
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "build" in item.keywords and not toolkit:
            item.add_marker(pytest.mark.skip(reason="needs the CUDA toolkit (nvcc)"))


def hypothesis_home(tmp_path_factory) -> Path:
    """Where hypothesis keeps its example database and caches: inside pytest's base temp directory, which
    pytest makes private to this user (0700, its owner checked) and new for each run. Never a fixed name
    in the shared temp directory, where another user could have planted a symbolic link or a
    world-writable directory first."""
    return tmp_path_factory.getbasetemp() / "hypothesis"


@pytest.hookimpl(trylast=True)  # after pytest's tmpdir plugin has made config._tmp_path_factory
def pytest_configure(config):
    """Before collection: hypothesis' pytest plugin writes its constants cache while the tests are
    collected (its home is ./.hypothesis, in the checkout, unless set)."""
    try:
        from hypothesis.configuration import set_hypothesis_home_dir
    except ImportError:  # only test_host_pool.py needs hypothesis
        return
    factory = getattr(config, "_tmp_path_factory", None)  # tmp_path_factory's object (pytest's tmpdir plugin)
    if factory is None:
        from _pytest.tmpdir import TempPathFactory

        factory = TempPathFactory.from_config(config, _ispytest=True)
    set_hypothesis_home_dir(str(hypothesis_home(factory)))


def pytest_collection_finish(session):
    """Says so before a run that will download the recorded SGLang releases' wheels (the slow release
    tests: about 1.5 GB the first time), instead of a silent wait; shown with -q too."""
    modules = {item.module.__name__ for item in session.items if "slow" in item.keywords and item.module}
    if not modules & {"test_sglang_releases", "test_sglang_log_lines", "test_sglang_integration", "test_sglang_plan"}:
        return
    try:
        import release_kit

        root = Path(os.environ.get("SGLANG_HICACHE_JIT_TEST_RELEASES")  # release_kit.cache_root(), not made here
                    or os.path.expanduser("~/.cache/sglang-hicache-jit-tests"))
        missing = [v for v in release_kit.recorded() if not list(root.glob(f"sglang-{v}-*/.complete"))]
    except Exception:  # a broken cache or record is for the tests themselves to report
        return
    if missing:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"sglang-hicache-jit: the SGLang release tests download {len(missing)} recorded "
                                f"release wheel(s) with pip (about 1.5 GB for all of them, once) into {root}")


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory):
    """A private cache root for the whole session (kept unless the caller named one)."""
    if os.environ.get("SGLANG_HICACHE_JIT_TEST_KEEP_CACHE"):
        yield Path(os.environ["SGLANG_HICACHE_JIT_CACHE_DIR"])
        return
    root = tmp_path_factory.mktemp("hicache-cache")
    old = os.environ.get("SGLANG_HICACHE_JIT_CACHE_DIR")
    os.environ["SGLANG_HICACHE_JIT_CACHE_DIR"] = str(root)
    yield root
    if old is None:
        os.environ.pop("SGLANG_HICACHE_JIT_CACHE_DIR", None)
    else:
        os.environ["SGLANG_HICACHE_JIT_CACHE_DIR"] = old


@pytest.fixture
def copying_stand_in():
    """The stand-in cuda:0 whose launcher and copy engines really copy (tests/fake_gpu.py's copying_device),
    for one test: yields (the Copier, the copy engines)."""
    import fake_gpu
    from sglang_hicache_jit import ops

    with fake_gpu.copying_device(ops) as devices:
        yield devices


@pytest.fixture
def cpu_streams():
    """The torch.cuda stream, event and capture queries a staging area makes, answered on the CPU."""
    import fake_gpu

    with fake_gpu.stub_streams():
        yield


@pytest.fixture(params=["ints", "tensors"])
def staging_planner(request, monkeypatch):
    """Which planner a staged transfer uses: Python ints (the default for small ones) or tensor ops (forced)."""
    if request.param == "tensors":
        from sglang_hicache_jit.transfer import staging

        monkeypatch.setattr(staging, "SMALL_BACKUP_TOKENS", 0)
    return request.param
