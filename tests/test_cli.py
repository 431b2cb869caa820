"""The CLI's surface: options anywhere, counts that say what happened, JSON shapes, errors without tracebacks.

No GPU and no compiler needed: entries are fakes (fleet_helpers), most commands run in this process.
"""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from fleet_helpers import ROOT, env_for, fake_entry
from sglang_hicache_jit import cli, settings
from sglang_hicache_jit.buildcache.arch import parse_arch_list
from sglang_hicache_jit.buildcache.bundle import export_bundle
from sglang_hicache_jit.buildcache.cache import BuildCache

NO_GPU = not torch.cuda.is_available()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    for name in (settings.ARCH, settings.TORCH_ARCH_LIST, settings.PREBUILT_DIRS, settings.CACHE_MAX_SIZE,
                 settings.LOCK_DIR, settings.LOCK_TIMEOUT):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path / "cache"))
    return BuildCache(tmp_path / "cache")


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv) -> dict:
    code, out, _ = run(capsys, *argv, "--json")
    document = json.loads(out)
    assert isinstance(document, dict) and document["schema"] == 1, document
    return document


def test_quiet_and_verbose_work_before_and_after_the_command():
    parser = cli.build_parser()
    assert parser.parse_args(["-q", "info"]).quiet is True
    assert parser.parse_args(["info", "-q"]).quiet is True
    assert parser.parse_args(["info"]).quiet is False
    assert parser.parse_args(["-v", "clean", "--failed"]).verbose is True
    assert parser.parse_args(["prune", "--verbose"]).verbose is True
    assert parser.parse_args(["-q", "bench", "--tokens", "1024"]).quiet is True
    assert parser.parse_args(["bench", "-q"]).quiet is True


def test_help_of_every_command_imports_no_torch():
    code = ("import sys\nfrom sglang_hicache_jit import cli\n"
            "for command in ('bench', 'demo', 'prewarm', 'info', 'doctor'):\n"
            "    try:\n        cli.main([command, '--help'])\n    except SystemExit as exc:\n"
            "        assert exc.code == 0, exc\n"
            "assert 'torch' not in sys.modules, 'torch was imported before parsing'\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--workloads" in out.stdout and "--tokens" in out.stdout


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU answer")
@pytest.mark.parametrize("argv", [["-q", "bench"], ["bench", "-q", "--tokens", "1024"]])
def test_bench_without_gpu_says_so_without_a_traceback(capsys, argv):
    code, out, err = run(capsys, *argv)
    assert code == 2 and err.startswith("error: bench needs a CUDA GPU") and "Traceback" not in err


def test_clean_counts_entries_not_paths(cache, capsys):
    fake_entry(cache)
    cache.record_failure("sm90", "hicache_transfer", "0" * 16, "nvcc said no", "log\n")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = cache.layout_root / ".staging" / f"hicache_transfer-0.{socket.gethostname()}.{dead.stdout.strip()}.ab"
    leftover.mkdir(parents=True)  # the staging directory of a builder that died
    live = cache.new_staging_dir("hicache_transfer-1")  # this process's: kept, and not counted
    code, out, _ = run(capsys, "clean", "--failed")
    assert code == 0 and out.startswith("forgot 1 failed build under ")
    code, out, _ = run(capsys, "clean")
    assert code == 0, out
    assert out.startswith("removed 1 cache entry, 0 failed-build records and 1 leftover build directory from ")
    assert live.is_dir() and not leftover.exists()
    assert run_json(capsys, "clean") == {"schema": 1, "root": str(cache.root), "entries": 0, "failed_builds": 0,
                                         "leftovers": 0, "skipped_locked": []}


def test_import_says_what_it_imported_and_what_it_kept(cache, tmp_path, capsys, monkeypatch):
    fake_entry(cache)
    bundle = tmp_path / "b.tar.gz"
    export_bundle([parse_arch_list("9.0")], str(bundle))
    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path / "other"))
    code, out, _ = run(capsys, "import", str(bundle))
    assert code == 0 and out.splitlines()[-1].startswith("imported 1 entry and kept 0 already present")
    code, out, _ = run(capsys, "import", str(bundle))
    assert code == 0 and out.splitlines()[-1].startswith("imported 0 entries and kept 1 already present")
    document = run_json(capsys, "import", str(bundle))
    assert [e["action"] for e in document["entries"]] == ["kept"] and document["bundle"] == str(bundle)


def test_info_lists_layers_and_every_setting_with_its_source(cache, tmp_path, capsys, monkeypatch):
    layer = BuildCache(tmp_path / "layer")
    fake_entry(layer)
    monkeypatch.setenv(settings.PREBUILT_DIRS, str(layer.root))
    monkeypatch.setenv(settings.LOCK_TIMEOUT, "120")
    monkeypatch.setenv(settings.ARCH, "9.0")
    info = run_json(capsys, "info")
    by_name = {s["variable"]: s for s in info["settings"]}
    assert by_name[settings.LOCK_TIMEOUT]["value"] == 120.0 and by_name[settings.LOCK_TIMEOUT]["source"] == "env"
    assert by_name[settings.METHOD]["value"] == "auto" and by_name[settings.METHOD]["source"] == "default"
    assert [(layer_["kind"], len(layer_["entries"])) for layer_ in info["layers"]] == [("prebuilt", 1), ("cache", 0)]
    assert info["target"]["archs"] == "9.0" and info["target"]["available_from"] == f"prebuilt layer {layer.root}"
    code, out, _ = run(capsys, "info")
    assert f"{settings.LOCK_TIMEOUT}    120.0  (env)" in out
    assert f"loads 9.0 (from {settings.ARCH}): prebuilt layer {layer.root}" in out


def test_info_reports_a_bad_setting_instead_of_failing(cache, capsys, monkeypatch):
    monkeypatch.setenv(settings.LOCK_TIMEOUT, "soon")
    code, out, _ = run(capsys, "info")
    assert code == 0 and "INVALID: SGLANG_HICACHE_JIT_LOCK_TIMEOUT='soon' cannot be used" in out


def test_effective_settings_name_every_variable(monkeypatch):
    for name in settings.RETIRED:
        monkeypatch.delenv(name, raising=False)
    constants = {value for name, value in vars(settings).items()
                 if name.isupper() and isinstance(value, str) and value.isupper() and "_" in value}
    assert constants - set(settings.RETIRED) == {s["variable"] for s in settings.effective()}


def test_a_retired_setting_still_set_is_named_as_having_no_effect(cache, capsys, monkeypatch):
    """SGLANG_HICACHE_JIT_DRIVER_BATCH turned on the driver's batch call, which returned wrong rows; the package
    no longer reads it, and info and doctor say so rather than show it as a working switch."""
    monkeypatch.setenv(settings.DRIVER_BATCH, "1")
    code, out, _ = run(capsys, "info")
    line, = [l for l in out.splitlines() if settings.DRIVER_BATCH in l]
    assert code == 0 and "retired, has no effect" in line
    shown, = [s for s in run_json(capsys, "info")["settings"] if s["variable"] == settings.DRIVER_BATCH]
    assert shown["retired"] and shown["error"] is None
    checks = {c["name"]: c for c in run_json(capsys, "doctor")["checks"]}
    assert f"{settings.DRIVER_BATCH} is set but retired and has no effect" in checks["settings"]["detail"]
    monkeypatch.delenv(settings.DRIVER_BATCH)
    assert settings.DRIVER_BATCH not in run(capsys, "info")[1]


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU answer")
def test_doctor_says_when_it_checked_no_arch(cache, capsys):
    code, out, _ = run(capsys, "doctor")
    assert "no arch was checked" in out.splitlines()[-1]
    assert run_json(capsys, "doctor")["archs_checked"] == []
    assert run_json(capsys, "doctor", "--arch", "9.0")["archs_checked"] == ["9.0"]


def test_check_has_one_shape_with_and_without_arch(cache, capsys):
    with_arch = run_json(capsys, "check", "--arch", "9.0", "--no-build")
    without = run_json(capsys, "check", "--no-build")
    assert set(with_arch) == set(without) == {"schema", "ok", "results"}
    assert set(with_arch["results"][0]) == set(without["results"][0])
    assert with_arch["results"][0]["code"] == "not_built" and not with_arch["ok"]


@pytest.mark.parametrize("argv", [["prewarm", "--json"], ["prune", "--json"], ["check", "--arch", "9.0", "--json"]])
def test_every_json_output_carries_the_schema(cache, capsys, monkeypatch, argv):
    monkeypatch.setenv(settings.ARCH, "9.0")
    fake_entry(cache)  # prewarm and check find it: nothing is compiled
    _, out, _ = run(capsys, *argv)
    assert json.loads(out)["schema"] == 1


@pytest.mark.parametrize("argv,exit_code,words", [
    (["import", "/nonexistent/b.tar.gz"], 1, "error: [bundle_unreadable]"),
    (["prune", "--max-size", "lots"], 2, "error: [bad_setting] --max-size 'lots': 'lots' is not a size"),
    (["check", "--arch", "nine"], 2, "error: [bad_setting] --arch 'nine'"),
    (["demo", "--tokens", "100"], 2, "error: [bad_setting] --tokens 100"),
])
def test_expected_errors_are_one_line_and_a_fix_not_a_traceback(cache, capsys, argv, exit_code, words):
    code, out, err = run(capsys, *argv)
    assert code == exit_code and err.startswith(words) and "(fix: " in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_a_hicache_error_prints_its_code_and_fix(cache, capsys, monkeypatch):
    from sglang_hicache_jit.errors import ToolchainError

    def fail(args):
        raise ToolchainError("nvcc is missing.\nsecond line of detail", "install it.", code="no_nvcc",
                             log_path="/x/build.log")

    monkeypatch.setattr(cli, "cmd_info", fail)
    code, out, err = run(capsys, "info")
    assert code == 1 and err.splitlines() == ["error: [no_nvcc] nvcc is missing. (fix: install it.)"]
    with pytest.raises(ToolchainError):  # -v: the traceback, for a bug report
        cli.main(["-v", "info"])

    def bug(args):
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "cmd_info", bug)
    with pytest.raises(KeyError):  # not an expected error: its traceback is for the report
        cli.main(["info"])


def test_no_numpy_warning_from_the_cli(tmp_path):
    """Without numpy, torch warns at import; the CLI's first line must not be that warning."""
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "numpy.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    env = env_for(tmp_path / "cache")
    env["PYTHONPATH"] = f"{stub}{os.pathsep}{env['PYTHONPATH']}"
    # The control (does this torch warn?) and the CLI run side by side: each spends 1.5 s importing torch.
    control, cli_run = (subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True)
                        for argv in ([sys.executable, "-c", "import torch"],
                                     [sys.executable, "-m", "sglang_hicache_jit", "check"]))
    _, control_err = control.communicate(timeout=120)
    _, err = cli_run.communicate(timeout=120)
    if "Failed to initialize NumPy" not in control_err:
        pytest.skip("this torch does not warn without numpy; nothing to check")
    assert "Warning" not in err and "NumPy" not in err, err


# ---- issue 35 and issue 33 item 6: demo's size, its blame, and its progress -------------------------------------

def test_demo_refuses_tokens_that_do_not_fit_before_allocating(cache, capsys, monkeypatch):
    """--tokens 1099511627776 printed torch's allocation traceback; now one line says what fits."""
    import torch as real_torch

    def no_allocation(*args, **kwargs):
        raise AssertionError("the demo allocated before checking the size")

    monkeypatch.setattr(real_torch, "randint", no_allocation)
    code, out, err = run(capsys, "demo", "--tokens", "1099511627776")
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: [bad_setting] --tokens 1099511627776:") and "tokens fit here" in err, err


def test_check_tokens_names_what_fits_in_host_and_gpu_memory(monkeypatch):
    from sglang_hicache_jit.bench import demo

    monkeypatch.delenv(settings.STAGING, raising=False)
    monkeypatch.setattr(demo, "_available_host_bytes", lambda: 100 * 2**20)
    per_token = demo.memory_needed(1, False)["host"]
    fits = 100 * 2**20 // per_token // 64 * 64
    demo.check_tokens(fits, on_gpu=False)
    with pytest.raises(ValueError, match=f"host memory .* at most {fits} tokens fit here"):
        demo.check_tokens(fits + 64, on_gpu=False)
    monkeypatch.setattr(demo, "_available_host_bytes", lambda: 1 << 50)
    monkeypatch.setattr(demo.torch.cuda, "mem_get_info", lambda *a: (2**30, 80 * 2**30))
    with pytest.raises(ValueError, match="GiB of GPU memory and 1.0 GiB is free; at most 11648 tokens fit here"):
        demo.check_tokens(1 << 20, on_gpu=True)
    for bad in (0, -64, 100, 64.0, True, "64"):
        with pytest.raises(ValueError, match="positive multiple of 64"):
            demo.check_tokens(bad, on_gpu=False)


@pytest.mark.parametrize("value", ["\u0663", "lots", "\uff15\uff11\uff12M"])
def test_demo_blames_a_bad_staging_setting_not_tokens(cache, capsys, monkeypatch, value):
    monkeypatch.setenv(settings.STAGING, value)
    code, out, err = run(capsys, "demo", "--tokens", "64")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: [bad_setting] SGLANG_HICACHE_JIT_STAGING") and "--tokens" not in err, err


@pytest.mark.parametrize("argv", [("demo", "--tokens", "\u0666\u0664"), ("check", "--device", "\u0663"),
                                  ("prune", "--older-than", "\u0663"), ("bench", "--tokens", "\u0661\u0660\u0662\u0664"),
                                  ("bench", "--gemm-seconds", "\uff15")])
def test_numeric_options_take_ascii_digits_only(cache, capsys, argv):
    """int() and float() take other scripts' digits: '--device ٣' was device 3, '--tokens ٦٤' 64 tokens."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse's usage error
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err and "digits 0-9" in err, err


@pytest.mark.skipif(not NO_GPU, reason="the GPU edition checks its lines in test_host_pool_gpu.py")
def test_demo_says_what_it_is_doing_while_it_runs(cache, capsys, monkeypatch):
    monkeypatch.delenv(settings.STAGING, raising=False)
    code, out, err = run(capsys, "demo", "--tokens", "128", "--json")
    assert code == 0 and json.loads(out)["schema"] == 1  # the lines go to stderr; stdout stays one document
    lines = [line for line in err.splitlines() if line.startswith("demo [")]
    steps = ["filling 8 layers", "building a page_first host pool", "direct path: backing up",
             "direct path: loading them back", "measuring the ceiling", "done"]
    assert len(lines) == len(steps) and all(step in line for step, line in zip(steps, lines)), err
    assert "HiCache host pool:" not in err  # the report says which path, without the pool's own line
    code, out, err = run(capsys, "-q", "demo", "--tokens", "128")
    assert code == 0 and "demo [" not in err
