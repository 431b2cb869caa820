"""The resident method's settings, names and benchmark providers (no GPU needed; the GPU tests are
tests/test_resident_gpu.py)."""

import pytest
import torch

from sglang_hicache_jit import ops, settings
from sglang_hicache_jit.bench import providers
from sglang_hicache_jit.errors import BadSettingError
from sglang_hicache_jit.transfer import abi, checks, launcher


def test_resident_settings_defaults_and_bounds(monkeypatch):
    monkeypatch.delenv(settings.RESIDENT_BLOCKS, raising=False)
    monkeypatch.delenv(settings.RESIDENT_IDLE_US, raising=False)
    assert settings.resident_blocks() == 4
    assert settings.resident_idle_us() == 2000
    monkeypatch.setenv(settings.RESIDENT_BLOCKS, "16")
    monkeypatch.setenv(settings.RESIDENT_IDLE_US, "0")
    assert settings.resident_blocks() == 16
    assert settings.resident_idle_us() == 0


@pytest.mark.parametrize("name, value", [(settings.RESIDENT_BLOCKS, "0"), (settings.RESIDENT_BLOCKS, "four"),
                                         (settings.RESIDENT_BLOCKS, "2000"), (settings.RESIDENT_IDLE_US, "-1"),
                                         (settings.RESIDENT_IDLE_US, "1.5")])
def test_bad_resident_settings_name_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    read = settings.resident_blocks if name == settings.RESIDENT_BLOCKS else settings.resident_idle_us
    with pytest.raises(BadSettingError, match=name):
        read()
    assert any(r["variable"] == name and r["error"] for r in settings.effective())


@pytest.mark.parametrize("value", ["resident", "RESIDENT", "resident-bulk", "resident-plain"])
def test_method_setting_accepts_resident(monkeypatch, value):
    monkeypatch.setenv(settings.METHOD, value)
    assert settings.method() == value.lower()


def test_method_codes():
    ops.reload_settings()
    resident = abi._RESIDENT
    # 'resident' runs the bulk engine both ways (the kernel falls back to plain where bulk cannot run).
    assert checks._method_code("resident", True) == resident | abi._METHODS["auto"]
    assert checks._method_code("resident", False) == resident | abi._METHODS["auto"]
    assert checks._method_code("resident-plain", False) == resident | abi._METHODS["plain"]
    assert checks._method_code("resident-bulk", True) == resident | abi._METHODS["bulk"]
    assert ops.METHOD_NAMES[resident | abi._METHODS["bulk"]] == "resident-bulk"
    with pytest.raises(ValueError, match="resident"):  # the message lists every method
        checks._method_code("residential", True)


def test_stop_resident_without_a_queue_is_a_no_op():
    ops.stop_resident()
    ops.stop_resident(0)


@pytest.mark.parametrize("name, parsed", [
    ("jit-resident", ("resident", None, {})),
    ("jit-resident-r8", ("resident", None, {"resident_blocks": 8})),
    ("jit-resident-bulk-r4-q2", ("resident-bulk", 2, {"resident_blocks": 4})),
    ("jit-resident-plain", ("resident-plain", None, {})),
])
def test_resident_providers_parse(name, parsed):
    assert providers._parse_jit_provider(name) == parsed
    providers.check_provider(name)


def test_direct_provider_is_known():
    providers.check_provider("direct")
    with pytest.raises(ValueError, match="direct"):  # the list of known providers names it
        providers.check_provider("indirect")


def test_device_arguments_take_ints_and_torch_devices():
    """check_errors, stop_resident and resident_stats name a device by index or torch.device (no GPU
    touched when nothing ran there)."""
    for device in (5, torch.device("cuda", 5)):
        assert launcher._device_index(device) == 5
        ops.check_errors(device)
        ops.stop_resident(device)
        assert ops.resident_stats(device) is None
