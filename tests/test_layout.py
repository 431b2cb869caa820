"""transfer/layout.py against written-out formulas: the per-layer byte offsets behind the all-layer ops'
address tables and the token -> row map of page_first_direct, for every layout (CPU only)."""

import pytest
import torch

from sglang_hicache_jit.errors import TransferIndexError
from sglang_hicache_jit.transfer import layout


@pytest.mark.parametrize("name", layout.LAYOUTS)
def test_layer_offsets_are_where_each_layer_s_rows_start(name):
    layers, slots, page, row = 3, 8, 4, (2, 5)  # 2 x 5 int32: 40-byte rows
    buf = torch.zeros(layout.buffer_shape(name, layers=layers, slots=slots, page_size=page, row_shape=row),
                      dtype=torch.int32)
    offsets = layout.layer_offsets(name, layers=layers, row_bytes=40, page_size=page, slots=slots)
    assert offsets == [layout.layer_rows(buf, name, i).data_ptr() - buf.data_ptr() for i in range(layers)]
    expected_step = {"layer_first": slots * 40, "page_first": 40, "page_first_direct": page * 40}[name]
    assert offsets == [0, expected_step, 2 * expected_step]


def test_layer_offsets_refuse_an_unknown_layout():
    with pytest.raises(ValueError, match="Unsupported layout"):
        layout.layer_offsets("page_unified", layers=2, row_bytes=4)


def test_page_first_direct_token_rows_match_the_buffer():
    layers, pages, page = 3, 4, 2
    buf = torch.arange(pages * layers * page, dtype=torch.int64).view(pages, layers, page)
    to_rows = layout.token_rows("page_first_direct", layers=layers, page_size=page, slots=pages * page)
    tokens = torch.arange(pages * page)
    for layer in range(layers):
        flat = layout.layer_rows(buf, "page_first_direct", layer)
        want = torch.stack([buf[t // page, layer, t % page] for t in tokens.tolist()])  # the reference
        assert torch.equal(flat[to_rows(tokens)], want)
    # one layer, and the layouts without a map: tokens are rows; the map itself still bounds them
    assert layout.token_rows("page_first_direct", layers=1, page_size=page, slots=8) is None
    one = layout.page_first_direct_map(layers=1, page_size=page, slots=8, name="src_indices")
    assert one(torch.arange(8)).tolist() == list(range(8))
    with pytest.raises(TransferIndexError, match="src_indices"):
        one(torch.tensor([8]))
    assert layout.token_rows("page_first", layers=layers, page_size=page, slots=8) is None
