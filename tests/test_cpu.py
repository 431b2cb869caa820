"""Behaviour that needs neither a GPU nor a compiler: import cost, the probe, op validation, the CLI."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sglang_hicache_jit import ops, probe

ROOT = Path(__file__).resolve().parent.parent
NO_GPU = not torch.cuda.is_available()


def test_import_is_light():
    code = ("import sys, time; t = time.perf_counter(); import sglang_hicache_jit; dt = time.perf_counter() - t; "
            "heavy = [m for m in ('torch', 'filelock', 'platformdirs') if m in sys.modules]; print(dt, heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    seconds, heavy = out.stdout.split(" ", 1)
    assert heavy.strip() == "[]" and float(seconds) < 0.05


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU answer")
def test_probe_without_gpu_never_raises_and_is_fast():
    probe.clear_cache()
    started = time.perf_counter()
    result = probe.probe(1152)
    assert time.perf_counter() - started < 1.0
    assert not result.available and result.code == "no_cuda_device" and "GPU" in result.reason
    assert probe.one_layer_kernel_available() is False


def test_probe_codes_for_disabled_and_bad_row_sizes(monkeypatch):
    assert probe.probe(6).code == "unsupported_element_size"
    assert probe.probe(0).code == "unsupported_element_size"
    assert probe.probe("576").code == "unsupported_element_size"
    monkeypatch.setenv("SGLANG_HICACHE_JIT_DISABLE", "1")
    result = probe.probe(576)
    assert result.code == "disabled" and not result.available


def test_probe_turns_unexpected_failures_into_results(monkeypatch):
    def boom(*a, **k):
        raise OSError("disk on fire")

    monkeypatch.setattr(probe, "_probe_device", boom)
    result = probe.probe(576)
    assert not result.available and result.code == "error" and "disk on fire" in result.reason


def _host(shape=(64, 16), dtype=torch.uint8, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


@pytest.mark.parametrize("call,error,words", [
    (lambda: ops.transfer_one_layer_mla("x", torch.arange(2), _host(), torch.arange(2)), TypeError, "cache_dst"),
    (lambda: ops.transfer_one_layer_mla(_host(), torch.arange(2), _host(), torch.arange(2)), ValueError, "pinned"),
    (lambda: ops.transfer_one_layer_mla(_host(device="meta"), torch.arange(2), _host(), torch.arange(2)),
     ValueError, "CUDA tensor or pinned"),
    (lambda: ops.transfer_one_layer_mla(torch.zeros(64), torch.arange(2), torch.zeros(64), torch.arange(2)),
     ValueError, "at least 2-D"),
    (lambda: ops.transfer_one_layer_mla(torch.zeros(64, 8, 4)[:, :, :2], torch.arange(2), _host(), torch.arange(2)),
     ValueError, "contiguous rows"),
], ids=["not-a-tensor", "pageable", "meta-device", "flat-without-element-dim", "strided-row"])
def test_cache_validation(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_element_dim_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="element_dim=7"):
        ops.transfer_one_layer_mla(_host(), torch.arange(2), _host(), torch.arange(2), element_dim=7)


@pytest.mark.skipif(NO_GPU, reason="pairs a CUDA side with a host side")
def test_pair_validation_on_gpu():
    dev = torch.zeros((64, 16), dtype=torch.uint8, device="cuda")
    host = torch.zeros((64, 16), dtype=torch.uint8, pin_memory=True)
    with pytest.raises(ValueError, match="dtype"):
        ops.transfer_one_layer_mla(dev, torch.arange(2), host.view(torch.int8), torch.arange(2))
    with pytest.raises(ValueError, match="same length"):
        ops.transfer_one_layer_mla(dev, torch.arange(3), host, torch.arange(2))
    with pytest.raises(TypeError, match="int32 or int64"):
        ops.transfer_one_layer_mla(dev, torch.arange(2.0), host, torch.arange(2))
    with pytest.raises(ValueError, match="multiple of 4"):
        ops.transfer_one_layer_mla(dev[:, :6], torch.arange(2), host[:, :6], torch.arange(2))
    with pytest.raises(ValueError, match="block_quota"):
        ops.transfer_one_layer_mla(dev, torch.arange(2), host, torch.arange(2), block_quota=0)


def _run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "sglang_hicache_jit", *args], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), timeout=120)


def test_cli_info_json_and_help():
    out = _run_cli("info", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["schema"] == 1 and info["package"]
    assert "SGLANG_HICACHE_JIT_CACHE_DIR" in {s["variable"] for s in info["settings"]}
    assert _run_cli("--help").returncode == 0


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU answer")
def test_cli_check_without_gpu_fails_with_the_code(capsys):
    # In this process (main() is what `python -m sglang_hicache_jit` runs; test_cli_info_json_and_help
    # runs that): two fresh interpreters importing torch cost 3 s of the default set.
    from adversarial_helpers import run_main

    code, out, _ = run_main(capsys, "check")
    assert code == 1 and out.startswith("no_cuda_device:")
    code, out, _ = run_main(capsys, "check", "--json")
    document = json.loads(out)
    assert code == 1
    assert document["schema"] == 1 and document["ok"] is False
    assert document["results"][0]["code"] == "no_cuda_device"


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU answer")
def test_cli_prewarm_without_gpu_or_arch_says_how_to_name_one(capsys, monkeypatch):
    from adversarial_helpers import run_main

    monkeypatch.setenv("SGLANG_HICACHE_JIT_ARCH", "")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "")
    code, _, err = run_main(capsys, "prewarm")
    assert code == 2 and "--arch 9.0" in err
