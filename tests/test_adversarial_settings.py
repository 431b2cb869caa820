"""Adversarial: bad settings and inputs through the CLI. Each must end in one `error:` line that names
the setting (or input) and the fix, with a non-zero exit and no traceback."""

import json
import os

import pytest

from adversarial_helpers import assert_one_error_line, cli_env, needs_root, run_main, small_fs  # noqa: F401
from fleet_helpers import cli, entry_dirs, fake_entry, snapshot
from sglang_hicache_jit import probe, settings
from sglang_hicache_jit.buildcache.arch import Arch, parse_arch_list, resolve_archs
from sglang_hicache_jit.buildcache.bundle import export_bundle
from sglang_hicache_jit.buildcache.cache import BuildCache
from sglang_hicache_jit import errors

ALL = ["SGLANG_HICACHE_JIT_LOCK_TIMEOUT", "SGLANG_HICACHE_JIT_BUILD_JOBS", "SGLANG_HICACHE_JIT_CACHE_MAX_SIZE",
       "SGLANG_HICACHE_JIT_ARCH", "TORCH_CUDA_ARCH_LIST", "SGLANG_HICACHE_JIT_LOCK_DIR",
       "SGLANG_HICACHE_JIT_PREBUILT_DIRS", "SGLANG_HICACHE_JIT_TRUSTED_OWNERS", "SGLANG_HICACHE_JIT_METHOD"]


@pytest.fixture
def env(tmp_path, monkeypatch):
    for name in ALL:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "cache"))
    return monkeypatch


@pytest.mark.parametrize("variable,value", [
    ("SGLANG_HICACHE_JIT_LOCK_TIMEOUT", "x"), ("SGLANG_HICACHE_JIT_LOCK_TIMEOUT", "-1"),
    ("SGLANG_HICACHE_JIT_LOCK_TIMEOUT", "0"), ("SGLANG_HICACHE_JIT_BUILD_JOBS", "x"),
    ("SGLANG_HICACHE_JIT_BUILD_JOBS", "0"), ("SGLANG_HICACHE_JIT_BUILD_JOBS", "-1"),
    ("SGLANG_HICACHE_JIT_BUILD_JOBS", "1.5"), ("SGLANG_HICACHE_JIT_BUILD_JOBS", "99999999999999999999"),
    ("SGLANG_HICACHE_JIT_ARCH", ";".join(f"{major}.{minor}" for major in range(1, 80) for minor in (0,))),
    ("SGLANG_HICACHE_JIT_ARCH", "Hoppper"), ("TORCH_CUDA_ARCH_LIST", "9.x"),
])
def test_a_bad_setting_stops_prewarm_with_one_line(env, tmp_path, capsys, variable, value):
    env.setenv(variable, value)
    args = ("prewarm",) if "ARCH" in variable else ("prewarm", "--arch", "9.0")
    code, out, err = run_main(capsys, *args)
    assert_one_error_line(code, err, variable, "fix:")
    assert code == 2
    staging = tmp_path / "cache" / "v1" / ".staging"
    assert not staging.exists() or not any(staging.iterdir()), "a staging directory leaked"


def test_bad_build_jobs_leaks_no_staging_directory_even_deep_in_a_build(env, tmp_path, monkeypatch):
    """The old code read BUILD_JOBS after making the staging directory, and left it behind."""
    from sglang_hicache_jit.buildcache import build as build_module
    from sglang_hicache_jit.buildcache import loader
    from sglang_hicache_jit.buildcache.toolchain import find_toolkit

    if find_toolkit() is None:
        pytest.skip("needs a CUDA toolkit")
    calls = []
    real = build_module.settings.build_jobs

    def bad_on_second_read():  # valid when ensure_built checks it, broken when the build reads it
        calls.append(1)
        if len(calls) > 1:
            raise errors.BadSettingError("SGLANG_HICACHE_JIT_BUILD_JOBS changed", "-")
        return real()

    monkeypatch.setattr(settings, "build_jobs", bad_on_second_read)
    with pytest.raises(errors.BadSettingError):
        loader.ensure_built(parse_arch_list("9.0"))
    staging = tmp_path / "cache" / "v1" / ".staging"
    assert not staging.exists() or not any(staging.iterdir())


@pytest.mark.parametrize("args", [("prune",), ("doctor", "--arch", "9.0"), ("import", "BUNDLE")])
def test_a_huge_cache_max_size(env, tmp_path, capsys, args):
    env.setenv("SGLANG_HICACHE_JIT_CACHE_MAX_SIZE", "9" * 400 + "T")
    args = tuple(str(tmp_path / "b.tar.gz") if a == "BUNDLE" else a for a in args)
    if "import" in args:
        env.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "source"))
        env.delenv("SGLANG_HICACHE_JIT_CACHE_MAX_SIZE")
        fake_entry(BuildCache(tmp_path / "source"))
        export_bundle([parse_arch_list("9.0")], args[1])
        env.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "cache"))
        env.setenv("SGLANG_HICACHE_JIT_CACHE_MAX_SIZE", "9" * 400 + "T")
    code, out, err = run_main(capsys, *args)
    assert "Traceback" not in err and "OverflowError" not in err + out
    if args[0] == "prune":
        assert_one_error_line(code, err, "SGLANG_HICACHE_JIT_CACHE_MAX_SIZE")
    elif args[0] == "doctor":
        assert code == 1 and "SGLANG_HICACHE_JIT_CACHE_MAX_SIZE" in out
    else:  # the import happened; the cap is housekeeping and only logged
        assert code == 0 and len(entry_dirs(tmp_path / "cache")) == 1


@pytest.mark.parametrize("variable", ["SGLANG_HICACHE_JIT_CACHE_DIR", "SGLANG_HICACHE_JIT_LOCK_DIR"])
@pytest.mark.parametrize("where", ["file", "below_a_file", "proc"])
def test_cache_or_lock_dir_on_a_file_or_in_proc(env, tmp_path, capsys, variable, where):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    value = {"file": a_file, "below_a_file": a_file / "sub", "proc": "/proc/self/hicache"}[where]
    env.setenv(variable, str(value))
    commands = [("prewarm", "--arch", "9.0"), ("info",), ("prune",), ("clean",)]
    if variable == "SGLANG_HICACHE_JIT_LOCK_DIR":
        commands = commands[:1]
    for args in commands:
        code, out, err = run_main(capsys, *args)
        assert_one_error_line(code, err, variable)
    code, out, err = run_main(capsys, "doctor", "--arch", "9.0")
    assert code == 1 and variable in out and "Traceback" not in err
    assert a_file.read_text() == "not a directory"


def test_into_a_file_is_refused_with_one_line(env, tmp_path, capsys):
    env.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "source"))
    fake_entry(BuildCache(tmp_path / "source"))
    export_bundle([parse_arch_list("9.0")], str(tmp_path / "b.tar.gz"))
    a_file = tmp_path / "layer"
    a_file.write_text("x")
    code, out, err = run_main(capsys, "import", str(tmp_path / "b.tar.gz"), "--into", str(a_file))
    assert_one_error_line(code, err, "--into")
    assert a_file.read_text() == "x"


def test_a_refused_into_leaves_no_directory_behind(env, tmp_path, capsys):
    env.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "source"))
    fake_entry(BuildCache(tmp_path / "source"))
    export_bundle([parse_arch_list("9.0")], str(tmp_path / "b.tar.gz"))
    layer = tmp_path / "layer"
    layer.mkdir()
    os.chmod(layer, 0o777)  # others could write there: refused
    code, out, err = run_main(capsys, "import", str(tmp_path / "b.tar.gz"), "--into", str(layer))
    assert_one_error_line(code, err, "unsafe_cache")
    assert list(layer.iterdir()) == [], "a refused import left an empty v1/"


@needs_root
@pytest.mark.parametrize("into", [False, True])
def test_a_full_disk_during_import(env, tmp_path, capsys, into):
    env.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "source"))
    fake_entry(BuildCache(tmp_path / "source"), payload=os.urandom(256 << 10))  # 256 KB does not fit in 64 KB
    export_bundle([parse_arch_list("9.0")], str(tmp_path / "b.tar.gz"))
    with small_fs(tmp_path / "small", "64k") as mount:
        target = mount / "target"
        env.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(target))
        args = ["import", str(tmp_path / "b.tar.gz")] + (["--into", str(target)] if into else [])
        code, out, err = run_main(capsys, *args)
        assert_one_error_line(code, err, "no_space")
        assert snapshot(mount) == {}, "a failed import left files behind"


def test_torch_named_archs_are_accepted(env):
    assert parse_arch_list("Hopper") == (Arch(9, 0, "", True),)
    assert parse_arch_list("ampere;hopper") == (Arch(8, 0), Arch(8, 6, "", True), Arch(9, 0, "", True))
    env.setenv("TORCH_CUDA_ARCH_LIST", "Hopper")
    assert resolve_archs() == ((Arch(9, 0, "", True),), "TORCH_CUDA_ARCH_LIST")


def test_probe_reports_a_bad_arch_setting_as_bad_setting(env, monkeypatch):
    """Configuration mistakes are bad_setting (naming the variable), never kernel_failed ("report it")."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for variable, value in (("TORCH_CUDA_ARCH_LIST", "Hoppper"), ("SGLANG_HICACHE_JIT_LOCK_TIMEOUT", "nan")):
        env.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
        env.setenv(variable, value)
        probe.clear_cache()
        result = probe.probe(build=False)
        assert result.code == "bad_setting" and variable in result.reason, result
        env.delenv(variable)
    probe.clear_cache()


@pytest.mark.parametrize("element_size", [[576], 576.0, "576", b"576", None.__class__, {"a": 1}, -4, 0, 6, True,
                                          2 ** 70 + 2])
def test_probe_never_raises_on_any_element_size(env, element_size):
    result = probe.probe(element_size, build=False)
    assert result.code == "unsupported_element_size" and not result.available, result


def test_probe_accepts_numpy_integers(env):
    np = pytest.importorskip("numpy")
    assert probe.probe(np.int64(576), build=False).code != "unsupported_element_size"


def test_block_quota_has_an_upper_bound():
    from sglang_hicache_jit import ops

    assert ops._quota(8) == 8
    for bad in (0, -1, 2 ** 40, 1.5, True, "8"):
        with pytest.raises(ValueError, match="block_quota"):
            ops._quota(bad)


def test_the_real_cli_prints_one_line_for_bad_settings(tmp_path):
    """One real subprocess, so the entry point itself (not just main()) is covered."""
    out = cli("prewarm", "--arch", "9.0", env=cli_env(tmp_path / "c", SGLANG_HICACHE_JIT_BUILD_JOBS="1.5"),
              timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().startswith("error: [bad_setting] SGLANG_HICACHE_JIT_BUILD_JOBS='1.5'"), out.stderr


# ---- issue 18: T1-T5, settings that ended in a traceback -------------------------------------------------

HUGE = "9" * 5000  # past Python's int-string limit (4300 digits): int() itself raised ValueError


def test_t1_info_shows_trusted_owners_named_by_user(env, capsys):
    env.setenv("SGLANG_HICACHE_JIT_TRUSTED_OWNERS", "root")
    code, out, err = run_main(capsys, "info")
    assert code == 0 and "Traceback" not in err, err
    line = next(line for line in out.splitlines() if "SGLANG_HICACHE_JIT_TRUSTED_OWNERS" in line)
    assert line.split()[1:] == ["0", "(env)"], line
    code, out, err = run_main(capsys, "info", "--json")
    setting = next(s for s in json.loads(out)["settings"] if s["variable"] == "SGLANG_HICACHE_JIT_TRUSTED_OWNERS")
    assert code == 0 and setting["value"] == [0] and setting["error"] is None


@pytest.mark.parametrize("variable", ["SGLANG_HICACHE_JIT_CACHE_DIR", "SGLANG_HICACHE_JIT_LOCK_DIR",
                                      "SGLANG_HICACHE_JIT_PREBUILT_DIRS"])
def test_t2_a_home_of_no_user_is_a_bad_setting_in_every_command(env, capsys, variable):
    env.setenv(variable, "~nosuchuser-hicache/c")
    commands = {"SGLANG_HICACHE_JIT_CACHE_DIR": [("prewarm", "--arch", "9.0"), ("info",), ("prune",), ("clean",),
                                                 ("check", "--arch", "9.0", "--no-build")],
                "SGLANG_HICACHE_JIT_LOCK_DIR": [("prewarm", "--arch", "9.0")],
                "SGLANG_HICACHE_JIT_PREBUILT_DIRS": [("prewarm", "--arch", "9.0"), ("info",)]}[variable]
    for args in commands:
        code, out, err = run_main(capsys, *args)
        assert_one_error_line(code, err, variable, "~nosuchuser-hicache names no user", "fix:")
        assert code == 2
    code, out, err = run_main(capsys, "doctor", "--arch", "9.0")
    assert code == 1 and "Traceback" not in err and f"{variable}='~nosuchuser-hicache/c' cannot be used" in out


@pytest.mark.parametrize("args", [("export", "--arch", "9.0", "-o", "~nosuchuser-hicache/b.tar.gz"),
                                  ("import", "~nosuchuser-hicache/b.tar.gz"),
                                  ("import", "B", "--into", "~nosuchuser-hicache/layer")])
def test_t2_a_home_of_no_user_in_an_option_is_one_line(env, tmp_path, capsys, args):
    fake_entry(BuildCache(tmp_path / "cache"))
    export_bundle([parse_arch_list("9.0")], str(tmp_path / "b.tar.gz"))
    args = tuple(str(tmp_path / "b.tar.gz") if a == "B" else a for a in args)
    code, out, err = run_main(capsys, *args)
    assert_one_error_line(code, err, "~nosuchuser-hicache names no user", "fix:")


@pytest.mark.parametrize("variable", ["SGLANG_HICACHE_JIT_BUILD_JOBS", "SGLANG_HICACHE_JIT_RESIDENT_BLOCKS",
                                      "SGLANG_HICACHE_JIT_RESIDENT_IDLE_US"])
@pytest.mark.parametrize("value", [HUGE, "0" * 5000 + "7" * 5000, "²", "٣"], ids=["9x5000", "0x5000+7x5000", "sup2",
                                                                                 "arabic3"])
def test_t3_one_bounded_reader_for_every_whole_number_setting(env, capsys, variable, value):
    env.setenv(variable, value)
    reader = {"SGLANG_HICACHE_JIT_BUILD_JOBS": settings.build_jobs,
              "SGLANG_HICACHE_JIT_RESIDENT_BLOCKS": settings.resident_blocks,
              "SGLANG_HICACHE_JIT_RESIDENT_IDLE_US": settings.resident_idle_us}[variable]
    with pytest.raises(errors.BadSettingError) as info:
        reader()
    assert variable in info.value.reason and "whole number from" in info.value.reason
    assert len(info.value.reason) < 300  # one line for a person, not the 5000 digits
    code, out, err = run_main(capsys, "info")
    line = next(line for line in out.splitlines() if variable in line)
    assert code == 0 and "INVALID" in line and "whole number from" in line and "int-string" not in line
    code, out, err = run_main(capsys, "doctor", "--arch", "9.0")
    assert code == 1 and "Traceback" not in err and f"{variable}=" in out
    if variable == "SGLANG_HICACHE_JIT_BUILD_JOBS":
        code, out, err = run_main(capsys, "prewarm", "--arch", "9.0")
        assert_one_error_line(code, err, variable, "whole number from 1 to 1024")


def test_t3_leading_zeros_are_still_a_number(env):
    env.setenv("SGLANG_HICACHE_JIT_BUILD_JOBS", "0" * 5000 + "8")
    assert settings.build_jobs() == 8


@needs_root
@pytest.mark.parametrize("value", ["²", HUGE, "4294967295", "-1", "x\udcffy"], ids=["sup2", "9x5000", "uid_max", "-1",
                                                                                   "surrogate"])
def test_t4_bad_trusted_owners_with_a_layer_of_another_user_is_one_line(env, tmp_path, capsys, value):
    from adversarial_helpers import NOBODY, chown_tree

    layer = tmp_path / "layer"
    fake_entry(BuildCache(layer))
    chown_tree(layer, NOBODY)
    env.setenv("SGLANG_HICACHE_JIT_PREBUILT_DIRS", str(layer))
    env.setenv("SGLANG_HICACHE_JIT_TRUSTED_OWNERS", value)
    code, out, err = run_main(capsys, "prewarm", "--arch", "9.0")
    assert_one_error_line(code, err, "SGLANG_HICACHE_JIT_TRUSTED_OWNERS", "fix:")
    assert code == 2


@pytest.mark.parametrize("version", [HUGE, "1" + "0" * 4999, "99999999999", "-13000"], ids=["9x5000", "1e4999", "1e11",
                                                                                       "negative"])
def test_t5_a_cuda_h_with_a_huge_version_is_not_a_toolkit(env, tmp_path, capsys, caplog, version):
    fake = tmp_path / "cuda"
    (fake / "bin").mkdir(parents=True)
    (fake / "include").mkdir()
    (fake / "bin" / "nvcc").write_text("#!/bin/sh\nexit 1\n")
    os.chmod(fake / "bin" / "nvcc", 0o755)
    (fake / "include" / "cuda.h").write_text(f"#define CUDA_VERSION {version}\n")
    env.setenv("CUDA_HOME", str(fake))
    env.delenv("CUDA_PATH", raising=False)
    fake_entry(BuildCache(tmp_path / "cache"))  # prewarm finds it: nothing is compiled
    for args in (("info",), ("doctor", "--arch", "9.0"), ("prewarm", "--arch", "9.0")):
        code, out, err = run_main(capsys, *args)
        assert "Traceback" not in err and "ValueError" not in err, err
        if args[0] != "doctor":
            assert code == 0, err
    assert f"CUDA_HOME={fake} is not a CUDA toolkit" in caplog.text


# ---- issue 18: SGLANG_HICACHE_JIT_SGLANG_PLUGIN=disable left the plugin on without a word ----------

@pytest.mark.parametrize("value", ["disable", "2", "none", "nan", "enabled", "-1"])
def test_a_plugin_switch_that_is_neither_on_nor_off_is_refused(env, capsys, caplog, value):
    from sglang_hicache_jit.integrations import sglang as plugin

    env.setenv("SGLANG_HICACHE_JIT_SGLANG_PLUGIN", value)
    with pytest.raises(errors.BadSettingError, match="SGLANG_HICACHE_JIT_SGLANG_PLUGIN"):
        settings.sglang_plugin_enabled()
    saved = dict(plugin.status)
    plugin.reload_for_tests()
    try:
        plugin.register()  # in SGLang's process: never raises, patches nothing, and says why
        assert plugin.status["registered"] is False and plugin.status["patched"] == []
        assert "SGLANG_HICACHE_JIT_SGLANG_PLUGIN" in plugin.status["reason"]
        assert "plugin not active" in caplog.text and value in caplog.text
    finally:
        plugin.status.clear()
        plugin.status.update(saved)
    code, out, err = run_main(capsys, "info")
    assert code == 0 and "Traceback" not in err, err
    assert any("SGLANG_HICACHE_JIT_SGLANG_PLUGIN" in line and "INVALID" in line for line in out.splitlines())
    assert "SGLang plugin not active, SGLang runs unchanged: SGLANG_HICACHE_JIT_SGLANG_PLUGIN=" in out
    code, out, err = run_main(capsys, "info", "--json")
    described = json.loads(out)["sglang_plugin"]
    assert described["active"] is False and described["switch"] is None and value in described["error"]
    code, out, err = run_main(capsys, "doctor", "--arch", "9.0")
    assert code == 1 and "SGLANG_HICACHE_JIT_SGLANG_PLUGIN=" in out and "Traceback" not in err


@pytest.mark.parametrize("value,enabled", [("", True), ("1", True), ("on", True), ("TRUE", True), ("yes", True),
                                           ("0", False), ("off", False), ("False", False), (" no ", False)])
def test_the_plugin_switch_still_reads_on_and_off(env, value, enabled):
    env.setenv("SGLANG_HICACHE_JIT_SGLANG_PLUGIN", value)
    assert settings.sglang_plugin_enabled() is enabled


# ---- issue 35: the size and number readers took other scripts' digits ('٣' read as 3 bytes, '５１２M' as 512 MiB) --

NUMERIC = {  # each numeric setting and its reader
    "SGLANG_HICACHE_JIT_STAGING": settings.staging_bytes,
    "SGLANG_HICACHE_JIT_CACHE_MAX_SIZE": settings.cache_max_size,
    "SGLANG_HICACHE_JIT_LOCK_TIMEOUT": settings.lock_timeout,
    "SGLANG_HICACHE_JIT_BUILD_JOBS": settings.build_jobs,
    "SGLANG_HICACHE_JIT_RESIDENT_BLOCKS": settings.resident_blocks,
    "SGLANG_HICACHE_JIT_RESIDENT_IDLE_US": settings.resident_idle_us,
    "SGLANG_HICACHE_BLOCK_QUOTA": settings.sglang_block_quota,
}
# Arabic-Indic 3, fullwidth 512M, Devanagari 4, mathematical bold 9, a superscript, '1' + Arabic-Indic 0,
# and an underscore between digits (float('1_0') is 10.0).
NOT_ASCII = ["\u0663", "\uff15\uff11\uff12M", "\u096a", "\U0001d7d7", "\u00b2", "1\u0660", "1_0"]


@pytest.mark.parametrize("variable", sorted(NUMERIC))
@pytest.mark.parametrize("value", NOT_ASCII, ids=["arabic-3", "fullwidth-512M", "devanagari-4", "bold-9",
                                                  "superscript-2", "1-arabic-0", "underscore"])
def test_numeric_settings_take_ascii_digits_only(env, variable, value):
    env.setenv(variable, value)
    with pytest.raises(errors.BadSettingError, match=variable) as info:
        NUMERIC[variable]()
    assert info.value.code == "bad_setting" and info.value.fix
    record, = [r for r in settings.effective() if r["variable"] == variable]
    assert record["value"] is None and variable in record["error"]


@pytest.mark.parametrize("variable, value, expected", [
    ("SGLANG_HICACHE_JIT_STAGING", "3", 3), ("SGLANG_HICACHE_JIT_STAGING", "512M", 512 << 20),
    ("SGLANG_HICACHE_JIT_STAGING", " 1.5 GiB ", 3 << 29), ("SGLANG_HICACHE_JIT_CACHE_MAX_SIZE", "10g", 10 << 30),
    ("SGLANG_HICACHE_JIT_LOCK_TIMEOUT", "120", 120.0), ("SGLANG_HICACHE_JIT_LOCK_TIMEOUT", "0.5", 0.5),
    ("SGLANG_HICACHE_JIT_LOCK_TIMEOUT", "1e3", 1000.0), ("SGLANG_HICACHE_JIT_LOCK_TIMEOUT", ".25", 0.25),
])
def test_ascii_numbers_still_read(env, variable, value, expected):
    env.setenv(variable, value)
    assert NUMERIC[variable]() == expected


def test_info_shows_a_foreign_digit_setting_as_invalid(env, capsys):
    env.setenv("SGLANG_HICACHE_JIT_STAGING", "\u0663")
    code, out, err = run_main(capsys, "info")
    assert code == 0 and "Traceback" not in err
    line, = [x for x in out.splitlines() if x.strip().startswith("SGLANG_HICACHE_JIT_STAGING")]
    assert "INVALID" in line and "0-9" in line
