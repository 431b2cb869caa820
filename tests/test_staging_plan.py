"""A staged backup's copies, planned once for all its chunks (staging.plan_chunks), run on the CPU: each chunk's
range of runs must empty exactly its own buffer into exactly its host blocks, whatever the order of the host
blocks, the chunk size and the longest run allowed."""

import pytest
import torch

from sglang_hicache_jit.transfer import direct, staging


def _backup(blocks, chunk: int, max_run: int, host_blocks: int = 64, layers: int = 3, row: int = 5):
    """``blocks``: a CPU int64 tensor, or the same as a list of ints (the small backups' path)."""
    gen = torch.Generator().manual_seed(len(blocks) * 31 + chunk)
    host = torch.zeros((host_blocks, layers, row), dtype=torch.int32)
    area = torch.empty((2 * chunk, layers, row), dtype=torch.int32)
    count = len(blocks)
    gathered = torch.randint(1, 1 << 30, (count, layers, row), generator=gen, dtype=torch.int32)
    pairs = direct.Pairs([(host.view(host_blocks, -1), area.view(2 * chunk, -1))])
    plan, parts = staging.plan_chunks(pairs, blocks, chunk, max_run)
    assert len(parts) == -(-count // chunk)
    for k, part in enumerate(parts):
        b, first = k % 2, k * chunk
        n = min(chunk, count - first)
        area.fill_(-1)  # the other buffer holds garbage: a run reading it would show
        area[b * chunk: b * chunk + n] = gathered[first:first + n]
        plan.run(pairs, part=part)
    expected = torch.zeros_like(host)
    expected[torch.as_tensor(blocks)] = gathered
    return host, expected


def _shuffled_runs(seed: int) -> torch.Tensor:
    """Runs of consecutive blocks with gaps, in a shuffled order of runs, as HiCache's allocator hands pages."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(64, generator=gen)[:40]
    pieces = [torch.arange(int(s), min(int(s) + int(torch.randint(1, 9, (1,), generator=gen)), 64))
              for s in order[:12]]
    return torch.tensor(list(dict.fromkeys(torch.cat(pieces).tolist())), dtype=torch.int64)  # no block twice


@pytest.mark.parametrize("as_ints", [False, True], ids=["tensor", "ints"])
@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 16, 64])
@pytest.mark.parametrize("max_run", [1, 2, 5, 1 << 20])
def test_every_chunk_lands_in_its_own_host_blocks(chunk, max_run, as_ints):
    blocks = _shuffled_runs(chunk * 1000 + max_run)
    host, expected = _backup(blocks.tolist() if as_ints else blocks, chunk, max_run)
    assert torch.equal(host, expected)


@pytest.mark.parametrize("chunk", [1, 3, 16, 64])
@pytest.mark.parametrize("max_run", [1, 2, 5, 1 << 20])
@pytest.mark.parametrize("seed", range(4))
def test_ints_and_tensors_give_the_same_plan(chunk, max_run, seed):
    """Backups of up to SMALL_BACKUP_TOKENS indices are planned from Python ints: the same runs, staged rows and
    parts as the tensor planner, or a chunk would empty the wrong rows."""
    blocks = _shuffled_runs(seed * 7 + chunk)
    pairs = direct.Pairs([(torch.zeros((64, 4)), torch.zeros((2 * chunk, 4)))])
    plan, parts = staging.plan_chunks(pairs, blocks, chunk, max_run)
    plan_ints, parts_ints = staging.plan_chunks(pairs, blocks.tolist(), chunk, max_run)
    assert plan_ints.runs.as_tuples() == plan.runs.as_tuples() and parts_ints == parts
    assert plan_ints.runs.dst_start.dtype == torch.int64


@pytest.mark.parametrize("chunk", [1, 3, 16, 64])
@pytest.mark.parametrize("max_run", [1, 2, 5, 1 << 20])
@pytest.mark.parametrize("count", [1, 2, 15, 16, 17, 48, 130])
def test_consecutive_blocks_are_planned_as_the_general_planner_plans_them(chunk, max_run, count):
    """Consecutive host blocks (a fresh allocation) skip the general planners: the runs and parts written out
    directly must be those the general planner finds, from a list of ints and from a tensor."""
    blocks = list(range(7, 7 + count))
    pairs = direct.Pairs([(torch.zeros((256, 4)), torch.zeros((2 * chunk, 4)))])
    general, general_parts = staging._plan_chunks_of_ints(pairs, blocks, chunk, max_run)
    for given in (blocks, torch.tensor(blocks)):
        plan, parts = staging.plan_chunks(pairs, given, chunk, max_run)
        assert plan.runs.as_tuples() == general.runs.as_tuples() and parts == general_parts


@pytest.mark.parametrize("as_ints", [False, True], ids=["tensor", "ints"])
@pytest.mark.parametrize("count", [1, 15, 16, 17, 48])
def test_consecutive_blocks_are_cut_at_every_chunk_boundary(count, as_ints):
    blocks = torch.arange(5, 5 + count)
    blocks = blocks.tolist() if as_ints else blocks
    host, expected = _backup(blocks, 16, 1 << 20)
    assert torch.equal(host, expected)
    pairs = direct.Pairs([(torch.zeros((64, 4)), torch.zeros((32, 4)))])
    plan, parts = staging.plan_chunks(pairs, blocks, 16, 1 << 20)
    assert [end - first for first, end in parts] == [1] * len(parts)  # one copy per full run inside a chunk
    assert plan.runs.src_start.tolist() == [k % 2 * 16 for k in range(len(parts))]


def test_a_part_of_a_plan_whose_runs_were_split_is_refused():
    pairs = direct.Pairs([(torch.zeros((64, 4)), torch.zeros((64, 4)))])
    runs = direct.Runs(torch.tensor([0]), torch.tensor([0]), torch.tensor([8]))
    plan = direct.CopyPlan(pairs, runs)
    with pytest.raises(ValueError, match="part"):
        plan.run(pairs, part=(0, 2))
    with pytest.raises(ValueError, match="part"):
        plan.run(pairs, part=(1, 0))
    plan.run(pairs, part=(0, 1))


@pytest.mark.parametrize("page, layers", [(1, 1), (1, 4), (16, 3), (64, 32)])
def test_staged_rows_are_the_page_first_direct_token_map(page, layers):
    """A staging buffer's blocks are laid out as page_first_direct host pages: token t of a chunk sits at row
    (t // page) * layers * page + t % page of a layer's flat rows, each row once."""
    from sglang_hicache_jit.transfer import staging

    tokens = 4 * page
    rows = staging.staged_rows(tokens, page, layers)
    t = torch.arange(tokens)
    assert rows.dtype == torch.int64 and torch.equal(rows, (t // page) * layers * page + t % page)
    assert rows.unique().numel() == tokens and int(rows.max()) < 4 * page * layers
