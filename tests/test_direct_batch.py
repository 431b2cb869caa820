"""The direct path's batched submission without a GPU: what reaches the runtime's cudaMemcpy3DBatchAsync,
from a stand-in runtime that records every call, and plans rebased to other layers."""

import pytest
import torch

from sglang_hicache_jit.transfer import cuda, descriptors, direct


class FakeRuntime:
    def __init__(self):
        self.batches = []

    def memcpy_batch(self, words, stream):
        self.batches.append((words.clone(), stream))


class FakeStream:
    cuda_stream = 99


def test_flat_and_strided_copies_go_to_the_3d_call_together():
    """A page_first_direct-like packed pair (flat pages) and a page_first-like strided pair in one transfer: every
    copy, flat or strided, is a descriptor of one cudaMemcpy3DBatchAsync call (the driver's batch call, which
    returned wrong rows, is never reached)."""
    row = 1152
    packed = (direct.Rows.at(1 << 40, row, row, 0), direct.Rows.at(1 << 41, row, row, 0))
    strided = (direct.Rows.at(1 << 42, row, row, 0), direct.Rows.at(1 << 43, 8 * row, row, 0))
    pairs = direct.Pairs([packed, strided])
    runs = direct.find_runs(torch.tensor([0, 1, 2, 10, 11]), torch.tensor([64, 65, 66, 128, 129]))
    plan = direct.CopyPlan(pairs, runs)
    runtime = FakeRuntime()
    direct._batch_on(runtime, plan.descriptors(pairs), FakeStream(), 0)
    (words, stream), = runtime.batches
    assert stream == 99 and torch.equal(words, plan.words) and words.shape[0] == 4
    col = {k: v // 8 for k, v in cuda.DESCRIPTOR_OFFSETS.items()}
    assert words[:2, col["dst.ptr"]].tolist() == [(1 << 40) + 0 * row, (1 << 40) + 10 * row]
    assert words[:2, col["extent.width"]].tolist() == [3 * row, 2 * row]  # flat: one block per run
    assert words[2:, col["extent.height"]].tolist() == [3, 2]             # strided: one row per line


# ---------------------------------------------------------------------------
# Plans made once and rebased: what a load's later layers submit.

def _fake_pairs(dst_base, src_base, strided=False):
    row = 1152
    packed = (direct.Rows.at(dst_base, row, row, 0, rows=4096), direct.Rows.at(src_base, row, row, 0, rows=4096))
    pairs = [packed]
    if strided:
        pairs.append((direct.Rows.at(dst_base + (1 << 36), row, row, 0, rows=4096),
                      direct.Rows.at(src_base + (1 << 36), 8 * row, row, 0, rows=4096)))
    return direct.Pairs(pairs)


@pytest.mark.parametrize("strided", [False, True], ids=["packed", "packed+strided"])
def test_a_plan_rebased_to_other_layers_equals_a_fresh_plan(strided):
    runs = direct.find_runs(torch.tensor([0, 1, 2, 10, 11, 40]), torch.tensor([64, 65, 66, 128, 129, 7]))
    first = _fake_pairs(1 << 40, 1 << 41, strided)
    plan = direct.CopyPlan(first, runs)
    for dst_base, src_base in ((1 << 40, 1 << 41), (3 << 40, 5 << 41), ((1 << 40) - 4096, 1 << 42)):
        other = _fake_pairs(dst_base, src_base, strided)
        fresh = direct.CopyPlan(other, runs)
        assert torch.equal(plan.descriptors(other), fresh.words)
    # The plan itself is unchanged by rebasing (later layers must not see earlier shifts).
    assert torch.equal(plan.words, direct.CopyPlan(first, runs).words)


@pytest.mark.parametrize("part", [(0, 1), (2, 3), (1, 4), (0, 5), (3, 3)])
@pytest.mark.parametrize("strided", [False, True], ids=["packed", "packed+strided"])
def test_a_part_of_a_plan_is_those_runs_of_every_pair_contiguous(part, strided):
    """A staged backup sends each chunk's runs of one plan (staging.plan_chunks): a part's descriptors must be
    exactly a fresh plan's for those runs, for every pair, rebased, and contiguous (the batch call reads them as
    an array: one run of two pairs as a strided view reached the GPU once and tripped its assert)."""
    runs = direct.find_runs(torch.tensor([0, 1, 2, 10, 11, 40, 50, 60]), torch.tensor([64, 65, 66, 128, 129, 7, 9, 3]))
    plan = direct.CopyPlan(_fake_pairs(1 << 40, 1 << 41, strided), runs)
    assert plan.n_runs == len(runs) == 5
    for bases in ((1 << 40, 1 << 41), (3 << 40, 5 << 41)):
        other = _fake_pairs(*bases, strided)
        first, end = part
        some = direct.Runs(runs.dst_start[first:end], runs.src_start[first:end], runs.length[first:end])
        words = plan.descriptors(other, part)
        assert words.is_contiguous() and words.shape[0] == len(other) * (end - first)
        assert torch.equal(words, direct.CopyPlan(other, some).words)


@pytest.mark.parametrize("seed", range(40))
def test_few_copies_are_described_as_the_vectorised_rows(seed, monkeypatch):
    """Up to SMALL_PLAN_COPIES copies, describe_copies builds its rows in Python: every word must equal the
    tensor-built rows', for packed and strided pairs, row sizes and run lengths of all kinds."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda high: int(torch.randint(1, high + 1, (1,), generator=gen))  # noqa: E731
    pairs = []
    for i in range(rand(4)):
        row = 4 * rand(1024)
        dst_stride, src_stride = row * rand(3), row * rand(3)
        pairs.append((direct.Rows.at((i + 1) << 40, dst_stride, row, 0, rows=1 << 16),
                      direct.Rows.at((i + 9) << 40, src_stride, row, 0, rows=1 << 16)))
    pairs = direct.Pairs(pairs)
    count = rand(40)
    runs = direct.Runs(torch.randint(0, 1 << 15, (count,), generator=gen),
                       torch.randint(0, 1 << 15, (count,), generator=gen),
                       torch.randint(1, 300, (count,), generator=gen))
    few = direct.describe_copies(pairs, runs)
    monkeypatch.setattr(descriptors, "SMALL_PLAN_COPIES", 0)
    rows = direct.describe_copies(pairs, runs)
    assert few.dtype == rows.dtype == torch.int64 and few.is_contiguous()
    assert torch.equal(few, rows)


def test_a_plan_refuses_pairs_of_another_geometry():
    runs = direct.find_runs(torch.arange(4), torch.arange(4))
    plan = direct.CopyPlan(_fake_pairs(1 << 40, 1 << 41), runs)
    assert not plan.fits(_fake_pairs(1 << 40, 1 << 41, strided=True))
    with pytest.raises(ValueError, match="pairs differ"):
        plan.run(_fake_pairs(1 << 40, 1 << 41, strided=True))


# ---- issue 34: the driver's batch call is gone, and its setting with it ------------------------------------------

def test_no_code_reaches_the_driver_s_batch_call():
    """The driver's cuMemcpyBatchAsync returned wrong rows without an error and crashed the GPU on driver
    580.159.04; no name of the package's sources calls or looks it up, and no mode sends copies to it."""
    from pathlib import Path

    root = Path(direct.__file__).resolve().parent.parent
    # libcuda is loaded in one place only, for cuMemGetAddressRange (transfer/extents.py: pointer tables).
    callers = [p for p in root.rglob("*.py") if "cuMemcpyBatchAsync(" in p.read_text()
               or ("libcuda.so" in p.read_text() and p.name != "extents.py")]
    assert callers == [] and direct.MODES == ("auto", "batch", "2d")
    assert not hasattr(direct, "DriverBatch") and not hasattr(direct, "driver_batch")


@pytest.mark.parametrize("value", ["1", "0", "disable"])
def test_the_retired_setting_changes_nothing(monkeypatch, value):
    """Set, whatever its value, the variable is read by no code path: a CPU transfer runs as without it."""
    monkeypatch.setenv("SGLANG_HICACHE_JIT_DRIVER_BATCH", value)
    dst, src = torch.zeros(8, 4, dtype=torch.uint8), torch.arange(32, dtype=torch.uint8).view(8, 4)
    assert direct.copy_rows([(dst, src)], torch.arange(4), torch.arange(4, 8)) == "torch"
    assert torch.equal(dst[:4], src[4:]) and not dst[4:].any()


@pytest.mark.gpu
def test_batched_copies_are_bit_exact_and_say_so():
    """On the GPU: modes 'batch' and 'auto' copy bit-exactly through cudaMemcpy3DBatchAsync, guard rows intact."""
    if not direct.batch_status()[0]:
        pytest.skip(direct.batch_status()[1])
    gen = torch.Generator().manual_seed(26)
    host = torch.randint(0, 256, (512, 1152), dtype=torch.uint8, generator=gen).pin_memory()
    idx = (torch.randperm(8, generator=gen)[:4, None] * 64 + torch.arange(64)).reshape(-1)
    for mode in ("batch", "auto"):
        dev = torch.zeros((512 + 2, 1152), dtype=torch.uint8, device="cuda")  # a guard row either side
        assert direct.copy_rows([(dev[1:-1], host)], idx, idx, mode=mode, page_size=64) == "batch"
        torch.cuda.synchronize()
        expected = torch.zeros_like(host)
        expected[idx] = host[idx]
        assert torch.equal(dev[1:-1].cpu(), expected) and not dev[0].any() and not dev[-1].any()
    assert "cudaMemcpy3DBatchAsync" in direct.batch_status()[1]
