"""Issue 26, "Tracebacks instead of one clear error": the cases that are not about indices or geometry.

* ``SlotAllocator`` larger than the machine (torch's out-of-memory error before);
* the resident method inside a CUDA graph capture (it invalidated the capture; GPU);
* ``tools/sglang_releases.py`` on a malformed wheel (StopIteration, SyntaxError, RecursionError before).
"""

import pytest

# ---- a slot allocator larger than the machine was torch's out-of-memory error ----------------------------------------

def test_a_slot_allocator_larger_than_the_machine_is_one_clear_error():
    from sglang_hicache_jit.transfer.slot_allocator import SlotAllocator

    with pytest.raises(ValueError, match=r"size=10000000000000 slots needs 83819\.0 GiB for the slot allocator's "
                                         r"bookkeeping \(9 B a slot\), more than this machine's .* GiB of memory; "
                                         r"at most \d+ slots fit \(whole pages of 64\)"):
        SlotAllocator(10**13, 64)


def test_a_slot_allocator_the_memory_free_now_cannot_hold_is_one_clear_error(monkeypatch):
    from sglang_hicache_jit.transfer import slot_allocator

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 bytes.")

    monkeypatch.setattr(slot_allocator.torch, "zeros", out_of_memory)
    with pytest.raises(ValueError, match=r"size=4096 slots needs 0\.0 GiB .*which could not be allocated "
                                         r"\(DefaultCPUAllocator: can't allocate memory.*\); .* GiB are free now; "
                                         r"at most \d+ slots fit"):
        slot_allocator.SlotAllocator(4096, 64)


# ---- the resident method inside a CUDA graph capture: creating its queue invalidated the capture --------------------

def test_no_resident_queue_is_created_while_a_graph_is_captured(monkeypatch):
    """Without a GPU: a stand-in device state whose queue creation fails the test; the capture launches as usual."""
    import ctypes
    import threading

    import torch

    from sglang_hicache_jit.transfer import resident

    class State(resident.ResidentQueue):
        device, resident = 0, None

        def __init__(self):
            self._resident_lock = threading.Lock()
            self._method_used = ctypes.c_int(0)
            self._method_used_ref = ctypes.byref(self._method_used)
            self.launched = []

        def submit(self, spec, method_used):
            self.launched.append(spec)
            self._method_used.value = 2

        def _create_resident_queue(self):
            raise AssertionError("the resident queue was created inside a graph capture")

    monkeypatch.setattr(resident, "_current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    state, spec = State(), ctypes.c_int(7)
    assert state._submit_resident(spec) == 2
    assert state.launched == [ctypes.addressof(spec)] and state.resident is None


@pytest.mark.gpu
def test_the_resident_method_inside_a_capture_records_an_ordinary_launch():
    import torch

    from sglang_hicache_jit import ops

    ops.stop_resident()
    host = torch.randint(0, 256, (1024, 1152), dtype=torch.uint8).pin_memory()
    dev = torch.zeros((2 + 512, 1152), dtype=torch.uint8, device="cuda")  # a guard row either side
    hidx = (torch.tensor([3, 9, 1, 14])[:, None] * 64 + torch.arange(64)).reshape(-1).cuda()
    didx = torch.arange(256, device="cuda")
    ops.transfer_one_layer_mla(dev[1:-1], didx, host, hidx)  # the device's state exists before the capture
    torch.cuda.synchronize()
    dev.zero_()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    try:
        with torch.cuda.graph(graph, stream=stream):  # the first resident transfer, inside the capture
            used = ops.transfer_one_layer_mla(dev[1:-1], didx, host, hidx, method="resident")
        assert not used.startswith("resident-") and ops.resident_stats() is None  # captured as a launch
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(dev[1:257].cpu(), host[hidx.cpu()]) and not dev[257:].any() and not dev[0].any()
        dev.zero_()
        assert ops.transfer_one_layer_mla(dev[1:-1], didx, host, hidx, method="resident").startswith("resident-")
        torch.cuda.synchronize()
        assert torch.equal(dev[1:257].cpu(), host[hidx.cpu()]) and ops.resident_stats()["queued"] == 1
    finally:
        ops.stop_resident()


# ---- tools/sglang_releases.py on a malformed wheel: StopIteration, SyntaxError, RecursionError -----------------------

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
HICACHE = "sglang/kernels/ops/kvcache/hicache.py"
MLA = "sglang/srt/mem_cache/pool_host/mla.py"
METADATA = ("sglang-0.5.99.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.99\nRequires-Dist: sglang-kernel==0.4.10\n")


@pytest.fixture(scope="module")
def tool():
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import sglang_releases
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return sglang_releases


def _wheel(tmp_path, members, name="sglang-0.5.99-py3-none-any.whl"):
    import zipfile

    path = tmp_path / name
    with zipfile.ZipFile(path, "w") as z:
        for member, data in members.items():
            z.writestr(member, data)
    return path


def _bad_crc(tmp_path):
    path = _wheel(tmp_path, dict([METADATA, (HICACHE, "def transfer_hicache_one_layer(a): pass\n")]))
    data = path.read_bytes()
    at = data.index(b"transfer_hicache_one_layer")
    path.write_bytes(data[:at] + b"X" + data[at + 1:])  # stored, not compressed: the CRC no longer holds
    return path


def _not_a_zip(tmp_path):
    path = tmp_path / "sglang-0.5.99-py3-none-any.whl"
    path.write_bytes(b"not a zip")
    return path


MALFORMED = {
    "no METADATA": (lambda t: _wheel(t, {HICACHE: "x = 1\n"}), r"has no \*\.dist-info/METADATA \(not a wheel\)"),
    "a module that does not parse": (lambda t: _wheel(t, dict([METADATA, (HICACHE, "def broken(:\n")])),
                                     rf"{HICACHE} does not parse as Python \(line 1: "),
    "classes that inherit from each other": (
        lambda t: _wheel(t, dict([METADATA, (MLA, "class A(B):\n    pass\n\n\nclass B(A):\n    pass\n\n\n"
                                                  "class MLATokenToKVPoolHost(A):\n"
                                                  "    def load_to_device_per_layer(self, a, b, c, d, e):\n"
                                                  "        pass\n")])),
        r"classes inherit from each other \(sglang\.srt\.mem_cache\.pool_host\.mla\.A -> "),
    "a default nested too deeply": (
        lambda t: _wheel(t, dict([METADATA, (HICACHE, "def transfer_hicache_one_layer(a=" + "-" * 900 + "1):\n"
                                                      "    pass\n")])),
        "nests deeper than Python's recursion limit allows to read it"),
    "a module nested too deeply for the parser": (
        lambda t: _wheel(t, dict([METADATA, (HICACHE, "x = a" + ".b" * 50000 + "\n")])),
        rf"{HICACHE} does not parse as Python \(RecursionError: "),
    "a module that is not UTF-8": (lambda t: _wheel(t, dict([METADATA, (HICACHE, b"x = '\xff'\n")])),
                                   rf"{HICACHE} is not UTF-8 \(byte 5\)"),
    "not a zip": (lambda t: _not_a_zip(t), r"is not a readable zip archive \(BadZipFile: "),
    "a member whose CRC fails": (_bad_crc, rf"{HICACHE} cannot be read \(BadZipFile: Bad CRC-32"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_wheel_is_one_clear_error_naming_it(tool, tmp_path, case):
    make, problem = MALFORMED[case]
    wheel = make(tmp_path)
    with pytest.raises(tool.MalformedWheel, match=rf"^{__import__('re').escape(str(wheel))}: {problem}"):
        tool.record_wheel(wheel, "0.5.99", {})


def test_a_sound_wheel_is_still_recorded(tool, tmp_path):
    wheel = _wheel(tmp_path, dict([METADATA, (HICACHE, "def transfer_hicache_one_layer(a, *, page_size=None):\n"
                                                       "    pass\n")]))
    record = tool.record_wheel(wheel, "0.5.99", {"w": "0"})
    assert record["sglang_kernel"] == "0.4.10" and record["plugins"] is False
    found = record["targets"]["sglang.kernels.ops.kvcache.hicache.transfer_hicache_one_layer"]
    assert [tuple(p) for p in found] == [("a", "POSITIONAL_OR_KEYWORD", None), ("page_size", "KEYWORD_ONLY", "None")]


def test_a_member_larger_than_the_tool_reads_is_refused(tool, tmp_path, monkeypatch):
    monkeypatch.setattr(tool, "MAX_MEMBER_BYTES", 100)
    wheel = _wheel(tmp_path, dict([METADATA, (HICACHE, "x = 1\n" * 40)]))
    with pytest.raises(tool.MalformedWheel, match=rf"{HICACHE} is larger than 100 bytes"):
        tool.record_wheel(wheel, "0.5.99", {})


def test_a_kernel_wheel_without_kvcacheio_is_refused(tool, tmp_path):
    wheel = _wheel(tmp_path, {"sgl_kernel/__init__.py": ""}, name="sglang_kernel-0.4.99-cp312-abi3.whl")
    with pytest.raises(tool.MalformedWheel, match=r"has no sgl_kernel/kvcacheio\.py"):
        tool.record_kernel_wheel(wheel, "0.4.99")


def test_the_tool_prints_one_error_line_and_writes_nothing(tool, tmp_path, monkeypatch, capsys):
    wheel = MALFORMED["classes that inherit from each other"][0](tmp_path)
    monkeypatch.setattr(tool, "download", lambda spec, dest, python: wheel)
    monkeypatch.setattr(tool, "sha256", lambda path: "0" * 64)

    def written(*args):
        raise AssertionError("the tool wrote records from a malformed wheel")

    monkeypatch.setattr(tool, "write_json", written)
    monkeypatch.setattr(tool, "write_tables", written)
    assert tool.main(["0.5.99", "--cache", str(tmp_path / "cache")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {wheel}: classes inherit from each other") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
