"""Moving blocks in and out of the paged KV cache: a copy per run of consecutive block ids, or one
index op where the ids scatter, must give the same bytes as the index ops alone."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import kv_cache
from pdserve.engine.kv_cache import KVPayloadError, gather_blocks, scatter_blocks

CACHE = torch.randn(3, 2, 64, 4, 2, 8).to(torch.bfloat16)
CASES = {
    "one run": list(range(10, 30)),
    "runs": [5, 6, 7, 40, 41, 2, 3, 4, 63],
    "a run per block": list(range(60, 0, -3)),  # more runs than _MAX_RUNS: the index ops
    "one block": [17],
}


@pytest.mark.parametrize("ids", CASES.values(), ids=CASES.keys())
def test_gather_and_scatter_move_the_same_bytes_as_the_index_ops(ids):
    expected = torch.index_select(CACHE, 2, torch.tensor(ids))
    assert torch.equal(gather_blocks(CACHE, ids), expected)
    out = torch.empty_like(expected)
    assert gather_blocks(CACHE, ids, out=out) is out and torch.equal(out, expected)

    payload = torch.randn(expected.shape).to(torch.bfloat16)
    mine, theirs = CACHE.clone(), CACHE.clone()
    scatter_blocks(mine, ids, payload)
    theirs.index_copy_(2, torch.tensor(ids), payload)
    assert torch.equal(mine, theirs)


def test_runs_are_found_where_the_ids_follow_each_other():
    runs = kv_cache._runs(torch.tensor([5, 6, 7, 40, 41, 2]))
    assert runs == [(5, 0, 3), (40, 3, 2), (2, 5, 1)]
    assert kv_cache._runs(torch.tensor(list(range(0, 64, 2)))) is None


def test_an_out_buffer_of_the_wrong_shape_is_refused():
    with pytest.raises(KVPayloadError, match="out is"):
        gather_blocks(CACHE, [1, 2, 3], out=torch.empty(3, 2, 2, 4, 2, 8, dtype=torch.bfloat16))
