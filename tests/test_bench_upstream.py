"""The benchmark's upstream SGLang providers without a GPU: their names, how they stand aside when SGLang
or its kernel is missing, the calls they make (through a stand-in for SGLang's module), and the
ours-vs-upstream summary and markdown table built from synthetic records.
"""

import importlib.util
import json
import types

import pytest
import torch

from fleet_helpers import ROOT
from sglang_hicache_jit.bench import upstream as bench_upstream
from sglang_hicache_jit.bench import command, modes, providers, report, workloads
from sglang_hicache_jit.bench.upstream import Unavailable

LAYERS = workloads.LAYERS


@pytest.mark.parametrize("name, parsed", [
    ("upstream", (None, None)), ("upstream-reg", ("reg", None)), ("upstream-tma", ("tma", None)),
    ("upstream-q8", (None, 8)), ("upstream-tma-q4", ("tma", 4)), ("upstream-q2-reg", ("reg", 2)),
])
def test_upstream_names_parse(name, parsed):
    assert bench_upstream.parse(name) == parsed
    providers.check_provider(name)


@pytest.mark.parametrize("name", ["upstream-foo", "upstream-q", "upstream-q0", "upstream-qx", "upstream-reg-tma",
                                  "upstream-q2-q4", "upstream-", "upstreamtma", "jit-x", "jit--q4", "torch"])
def test_bad_provider_names_are_refused(name):
    with pytest.raises(ValueError):
        providers.check_provider(name)


def test_a_bad_provider_name_ends_the_run_before_it_starts(capsys):
    code = command.run_parsed(command.parse_args(["--providers", "jit", "upstream-tmq"]))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: [bad_setting] bad provider 'upstream-tmq'")


@pytest.mark.parametrize("importable", [True, False])
def test_default_providers_have_upstream_only_when_sglang_imports(monkeypatch, importable):
    monkeypatch.setattr(bench_upstream, "importable", lambda: importable)
    names = providers._providers(command.parse_args(["--quotas", "4"]))
    upstream = [n for n in names if providers.family(n) == "upstream"]
    assert upstream == (["upstream", "upstream-reg", "upstream-tma"] if importable else [])
    assert names[0] == "ceiling" and names[-2:] == ["torch-index", "per-page"]
    explicit = providers._providers(command.parse_args(["--providers", "upstream-tma-q8", "jit"]))
    assert explicit == ["ceiling", "upstream-tma-q8", "jit"]


def test_families():
    assert [providers.family(n) for n in ("ceiling", "jit-bulk-q4", "upstream-reg", "torch-index", "per-page")] \
        == ["ceiling", "ours", "upstream", "baseline", "baseline"]


def _no_sglang(monkeypatch):
    monkeypatch.setattr(bench_upstream, "_load", lambda: (None, "ModuleNotFoundError: No module named 'sglang'"))


def test_without_sglang_build_call_says_why_before_touching_the_gpu(monkeypatch):
    _no_sglang(monkeypatch)
    with pytest.raises(Unavailable, match="not importable: ModuleNotFoundError"):
        providers.build_call("upstream-tma", None, "one", "h2d", 3, None, None, 64, {})


def test_a_replaced_sglang_function_is_not_measured_as_upstream(monkeypatch):
    fake = types.SimpleNamespace(**{name: _own(name) for name in bench_upstream.FUNCTIONS})
    fake.transfer_hicache_one_layer_mla = lambda *a, **k: None  # e.g. routed here by this package's plugin
    monkeypatch.setattr(bench_upstream, "_load", lambda: (fake, None))
    with pytest.raises(Unavailable, match="transfer_hicache_one_layer_mla .* not SGLang's own"):
        bench_upstream.module()


def _own(name):
    def fn(*args, **kwargs):
        pass
    fn.__module__, fn.__name__ = bench_upstream.MODULE, name
    return fn


def test_an_unavailable_provider_is_skipped_with_one_line_and_the_run_goes_on(monkeypatch, capsys):
    _no_sglang(monkeypatch)
    real_build = providers.build_call
    monkeypatch.setattr(providers, "build_call", lambda provider, *a: real_build(provider, *a)
                        if provider.startswith("upstream") else (lambda: None))
    monkeypatch.setattr(modes, "make_pools", lambda w, h, d, layout: workloads.Pools(1, 576, [], [], h, d, layout))
    monkeypatch.setattr(modes, "make_indices", lambda *a, **k: (None, None))
    monkeypatch.setattr(modes, "time_call", lambda fn: [1e-3, 2e-3, 3e-3])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    args = command.parse_args(["-q", "--workloads", "mla-fp8", "--scopes", "one", "all", "--page-sizes", "64",
                                 "--tokens", "1024", "--providers", "jit", "upstream-tma"])
    records = modes.run(args)
    out = capsys.readouterr().out
    assert out.count("skipped upstream-tma: SGLang's HiCache kernels") == 1, out
    assert len(out.splitlines()) == 1
    assert [r["provider"] for r in records] == ["ceiling", "jit"] * 4  # 2 scopes x 2 directions
    assert {r["family"] for r in records} == {"ceiling", "ours"}
    assert report.summarize(records)[0]["upstream"] is None


class FakeSGLang:
    """Stands in for sglang.kernels.ops.kvcache.hicache: its dispatcher says 'TMA' only for page sizes
    that are multiples of 16, and each transfer function notes its arguments and the kernel it would run."""

    TMA_BLOCK_QUOTA = 4

    def __init__(self):
        self.calls = []

    def use_hicache_tma_kernel(self, *, element_size, block_quota, page_size=None):
        return page_size is None or page_size % 16 == 0

    def can_use_hicache_jit_kernel(self, *, element_size, block_quota=None, page_size=None):
        return self.use_hicache_tma_kernel(element_size=element_size, block_quota=block_quota or 4,
                                           page_size=page_size) or element_size % 128 == 0

    def _note(self, name, args, kwargs):
        tma = self.use_hicache_tma_kernel(element_size=0, block_quota=0, page_size=kwargs["page_size"])
        self.calls.append((name, "tma" if tma else "reg", args, kwargs))

    def transfer_hicache_one_layer_mla(self, *args, **kwargs):
        self._note("one_mla", args, kwargs)

    def transfer_hicache_one_layer(self, *args, **kwargs):
        self._note("one", args, kwargs)

    def transfer_hicache_all_layer_mla(self, *args, **kwargs):
        self._note("all_mla", args, kwargs)

    def transfer_hicache_all_layer(self, *args, **kwargs):
        self._note("all", args, kwargs)


def _pools(caches, row_bytes, host_slots=64, device_slots=32):
    host = [torch.zeros((host_slots, LAYERS, row_bytes), dtype=torch.uint8) for _ in range(caches)]
    device = [[torch.zeros((device_slots, row_bytes), dtype=torch.uint8) for _ in range(LAYERS)]
              for _ in range(caches)]
    return workloads.Pools(caches, row_bytes, host, device, host_slots, device_slots)


def _build(up, provider, pools, scope="one", to_device=True, page_size=64):
    host_idx, dev_idx = torch.arange(4), torch.arange(4, 8)
    return bench_upstream.build_call(up, provider, pools, scope, to_device, 3, host_idx, dev_idx, page_size,
                                     LAYERS), host_idx, dev_idx


@pytest.mark.parametrize("provider, page_size, kernel", [
    ("upstream", 64, "tma"), ("upstream", 1, "reg"), ("upstream-reg", 64, "reg"), ("upstream-tma", 1, "tma"),
])
def test_the_kernel_named_is_the_kernel_run(provider, page_size, kernel):
    up = FakeSGLang()
    dispatcher = up.use_hicache_tma_kernel
    call, _, _ = _build(up, provider, _pools(1, 1152), page_size=page_size)
    call()
    assert call.kernel == kernel
    assert [c[1] for c in up.calls] == [kernel, kernel]  # the check call in build_call, then this one
    assert up.use_hicache_tma_kernel == dispatcher  # SGLang's own dispatcher is back after each call


def test_one_layer_calls_take_gpu_style_indices_and_swap_sides_by_direction():
    up = FakeSGLang()
    pools = _pools(1, 1152)
    _, host_idx, dev_idx = _build(up, "upstream-tma-q8", pools, to_device=True)
    name, _, args, kwargs = up.calls[-1]
    assert name == "one_mla" and kwargs == dict(element_dim=1152, block_quota=8, page_size=64)
    assert args[1] is dev_idx and args[3] is host_idx
    assert args[0].data_ptr() == pools.device[0][3].data_ptr() and args[2].data_ptr() == pools.host[0][:, 3].data_ptr()
    _, host_idx, dev_idx = _build(up, "upstream", pools, to_device=False)
    _, _, args, kwargs = up.calls[-1]
    assert args[1] is host_idx and args[3] is dev_idx and kwargs["block_quota"] is None
    assert args[0].data_ptr() == pools.host[0][:, 3].data_ptr()

    kv = _pools(2, 256)
    _build(up, "upstream-reg", kv, to_device=True)
    name, _, args, kwargs = up.calls[-1]
    assert name == "one" and args[2] is not None and kwargs["element_dim"] == 256
    expected = [kv.device[0][3], kv.device[1][3], kv.host[0][:, 3], kv.host[1][:, 3]]
    assert [args[i].data_ptr() for i in (0, 1, 3, 4)] == [t.data_ptr() for t in expected]


@pytest.mark.parametrize("caches", [1, 2])
def test_all_layer_calls_pass_pointer_tables_and_byte_strides(caches):
    up = FakeSGLang()
    pools = _pools(caches, 256)
    _build(up, "upstream", pools, scope="all", to_device=False)
    name, _, args, kwargs = up.calls[-1]
    host_table = [pools.host[0][:, l].data_ptr() for l in range(LAYERS)]
    dev_table = [t.data_ptr() for t in pools.device[0]]
    if caches == 1:
        assert name == "all_mla"
        assert kwargs["cache_dst_stride_bytes"] == LAYERS * 256 and kwargs["cache_src_stride_bytes"] == 256
        dst_table, src_table = args[0], args[2]
    else:
        assert name == "all"
        assert kwargs["kv_cache_dst_stride_bytes"] == LAYERS * 256 and kwargs["kv_cache_src_stride_bytes"] == 256
        dst_table, src_table = args[0], args[3]
        assert args[1].tolist() == [pools.host[1][:, l].data_ptr() for l in range(LAYERS)]
    assert dst_table.dtype == torch.uint64 and dst_table.tolist() == host_table and src_table.tolist() == dev_table
    assert kwargs["element_size"] == 256 and kwargs["page_size"] == 64


class FakeOldSGLang:
    """Stands in for the module of a release with the register kernel only (0.5.16, 0.5.17): no TMA
    dispatcher, no TMA_BLOCK_QUOTA, and transfer functions without a ``page_size`` keyword."""

    DEFAULT_BLOCK_QUOTA = 2

    def __init__(self):
        self.calls = []

    def can_use_hicache_jit_kernel(self, *, element_size, unroll=None, block_quota=None):
        return element_size % 128 == 0

    def transfer_hicache_one_layer(self, k_dst, v_dst, i_dst, k_src, v_src, i_src, *, element_dim=None,
                                   unroll=None, block_quota=None):
        self.calls.append(("one", element_dim, block_quota))

    def transfer_hicache_one_layer_mla(self, dst, i_dst, src, i_src, *, element_dim=None, unroll=None,
                                       block_quota=None):
        self.calls.append(("one_mla", element_dim, block_quota))


@pytest.mark.parametrize("provider, quota", [("upstream", None), ("upstream-reg", None), ("upstream-q4", 4)])
def test_a_release_without_the_tma_kernel_runs_its_register_kernel(provider, quota):
    up = FakeOldSGLang()
    call, _, _ = _build(up, provider, _pools(2, 2048))
    call()
    assert call.kernel == "reg"
    assert up.calls == [("one", 2048, quota)] * 2  # no page_size passed: the release's functions refuse it


def test_a_release_without_the_tma_kernel_skips_the_tma_provider_and_rows_it_cannot_take():
    up = FakeOldSGLang()
    with pytest.raises(Unavailable, match="no TMA HiCache kernel"):
        _build(up, "upstream-tma", _pools(1, 1152))
    with pytest.raises(Unavailable, match="register kernel does not take 576-byte rows"):
        _build(up, "upstream", _pools(1, 576))
    assert up.calls == []


def test_rows_or_builds_sglang_cannot_take_are_skipped_with_the_reason():
    up = FakeSGLang()
    with pytest.raises(Unavailable, match="register kernel does not take 576-byte rows"):
        _build(up, "upstream-reg", _pools(1, 576))
    with pytest.raises(Unavailable, match="no JIT kernel for 656-byte rows at page size 1"):
        _build(up, "upstream", _pools(1, 656), page_size=1)
    up.use_hicache_tma_kernel = lambda **_: False
    with pytest.raises(Unavailable, match="TMA kernel is off for 1152-byte rows"):
        _build(up, "upstream-tma", _pools(1, 1152))

    def no_build(**_):
        raise RuntimeError("tvm_ffi is not installed")
    up.can_use_hicache_jit_kernel = no_build
    with pytest.raises(Unavailable, match="cannot be built or loaded here: RuntimeError: tvm_ffi is not installed"):
        _build(up, "upstream", _pools(1, 1152))


def test_a_provider_whose_first_call_fails_is_skipped():
    up = FakeSGLang()

    def broken(*args, **kwargs):
        raise ValueError("indices must be on the GPU")
    up.transfer_hicache_one_layer_mla = broken
    with pytest.raises(Unavailable, match="first call failed: ValueError: indices must be on the GPU"):
        _build(up, "upstream-tma", _pools(1, 1152))
    assert up.use_hicache_tma_kernel.__func__ is FakeSGLang.use_hicache_tma_kernel  # restored after the failure


def _record(provider, ratio, page_size=64, tokens=1024, workload="mla-bf16", kernel=None, **extra):
    return dict(workload=workload, scope="one", direction="h2d", page_size=page_size, tokens=tokens,
                provider=provider, family=providers.family(provider), kernel=kernel, gbps=50.0 * ratio,
                ratio=ratio, **extra)


RECORDS = [
    _record("ceiling", 1.0), _record("jit", 0.8), _record("jit-q8", 0.9), _record("upstream-reg", 0.5, kernel="reg"),
    _record("upstream-tma", 0.6, kernel="tma"), _record("torch-index", 0.95),
    _record("ceiling", 1.0, page_size=1), _record("jit", 0.7, page_size=1),
    dict(mode="interference", workload="mla-bf16", direction="h2d", tokens=1024, page_size=64, provider="upstream",
         family="upstream", ratio_loaded=0.99),
]


def test_summary_puts_the_best_of_ours_beside_the_best_of_upstream_per_cell():
    rows = report.summarize(RECORDS)
    assert [(r["page_size"], r["ours"], r["upstream"]) for r in rows] == [(64, "jit-q8", "upstream-tma"),
                                                                         (1, "jit", None)]
    first = rows[0]
    assert first["ours_ratio"] == 0.9 and first["upstream_ratio"] == 0.6 and first["upstream_kernel"] == "tma"
    assert first["quotient"] == pytest.approx(1.5) and first["ceiling_gbps"] == 50.0
    assert rows[1]["quotient"] is None and rows[1]["upstream_ratio"] is None
    lines = report.summary_lines(rows)
    assert lines[0].startswith("ours vs upstream") and "ours/upstream" in lines[1]
    assert lines[2].split()[-5:] == ["jit-q8", "0.90", "upstream-tma", "0.60", "1.50"]
    assert lines[3].split()[-4:] == ["jit", "0.70", "-", "-"]
    json.dumps(rows)  # goes into the --json file as it is


def _bench_driver():
    spec = importlib.util.spec_from_file_location("bench_driver", ROOT / "tools" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_report_renders_ours_vs_upstream_as_markdown(tmp_path, capsys):
    driver = _bench_driver()
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"schema": 1, "records": [r for r in RECORDS if "mode" not in r]}))
    assert driver.main(["report", str(path), "--vs-upstream"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("| workload | layers | dir | page | tokens | ceiling | best ours | best upstream | "
                        "ours / upstream |")
    assert lines[2] == ("| mla-bf16 | one | h2d | 64 | 1024 | 50.0 | jit-q8 45.0 (0.90) | "
                        "upstream-tma [tma] 30.0 (0.60) | 1.50 |")
    assert lines[3] == "| mla-bf16 | one | h2d | 1 | 1024 | 50.0 | jit 35.0 (0.70) | - | - |"
    assert len(lines) == 4
    driver.main(["report", str(path)])  # the per-provider table still renders, upstream columns included
    assert "upstream-tma" in capsys.readouterr().out.splitlines()[0]


def test_an_interrupted_bench_writes_what_it_measured(tmp_path, monkeypatch):
    """`timeout` (SIGTERM) or Ctrl-C mid-run: the records measured so far still reach --json; exit code 130."""
    import os
    import signal

    def measure_then_stop(args, records):
        records.append(dict(workload="mla-bf16", provider="jit", gbps=1.0))
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(modes.MODES, "overhead", measure_then_stop)
    out = tmp_path / "partial.json"
    previous = signal.getsignal(signal.SIGTERM)
    assert command.run_parsed(command.parse_args(["--mode", "overhead", "--json", str(out)])) == 130
    assert json.loads(out.read_text())["records"] == [dict(workload="mla-bf16", provider="jit", gbps=1.0)]
    assert signal.getsignal(signal.SIGTERM) is previous
