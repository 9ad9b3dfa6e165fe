"""The PyTorch reference backend equals naive dense causal attention (no paging, a materialized
mask, float64) within 1e-5 in float32, on odd lengths, page sizes 1 and 16, GQA 1/3/8, with and
without a cached prefix, over shuffled block tables whose unused slots hold NaN."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.interface import AttentionBackend
from pdserve.kernels.reference import ReferenceBackend
from pdserve.kernels.testing import PagedCase, make_case

ATOL = RTOL = 1e-5
NUM_KV_HEADS = 2
HEAD_DIM = 16

LENGTHS = [1, 17, 1025]
BLOCK_SIZES = [1, 16]
GROUPS = [1, 3, 8]
PREFIXES = ["none", "one token", "several blocks"]


def prefix_tokens(kind: str, block_size: int) -> int:
    """0, 1, or three and a half blocks (the last one partly filled)."""
    return {"none": 0, "one token": 1, "several blocks": 3 * block_size + block_size // 2 + 1}[kind]


def naive_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float, window: int = 0
) -> torch.Tensor:
    """Dense oracle for one sequence: q [L, Hq, D] at positions prefix..prefix+L-1 over k/v
    [prefix+L, Hkv, D], with a sliding window of `window` keys where it is > 0. Query head h
    reads KV head h // (Hq / Hkv). Computed in float64."""
    q_len, hq, _ = q.shape
    ctx, hkv, _ = k.shape
    k = k.double().repeat_interleave(hq // hkv, dim=1)
    v = v.double().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q.double(), k) * scale  # [Hq, L, ctx]
    mask = torch.ones(q_len, ctx, dtype=torch.bool).tril(diagonal=prefix)  # key j <= prefix + i
    if window > 0:  # and key j > prefix + i - window
        mask &= ~torch.ones(q_len, ctx, dtype=torch.bool).tril(diagonal=prefix - window)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hij,jhd->ihd", scores.softmax(dim=-1), v)


def oracle(case: PagedCase, window: int = 0) -> torch.Tensor:
    """The oracle for every query row of a packed batch, [T, Hq, D] in float64."""
    outs = []
    cu = case.cu_seqlens_q.tolist()
    for b, prefix in enumerate(case.prefix_lens):
        q = case.q[cu[b] : cu[b + 1]]
        outs.append(naive_causal_attention(q, case.dense_k[b], case.dense_v[b], prefix, case.scale, window))
    return torch.cat(outs)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected, atol=ATOL, rtol=RTOL)


def run_prefill(case: PagedCase, backend: AttentionBackend | None = None) -> torch.Tensor:
    return (backend or ReferenceBackend()).prefill_attention(
        case.q, case.key, case.value, case.k_cache, case.v_cache,
        case.cu_seqlens_q, case.seq_lens, case.block_tables, case.scale,
    )  # fmt: skip


def run_decode(case: PagedCase) -> torch.Tensor:
    return ReferenceBackend().decode_attention(
        case.decode_q, case.k_cache, case.v_cache, case.seq_lens, case.block_tables, case.scale
    )


@pytest.mark.parametrize("prefix_kind", PREFIXES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("q_len", LENGTHS)
def test_prefill_equals_dense_causal_attention(q_len, block_size, group, prefix_kind):
    prefix = prefix_tokens(prefix_kind, block_size)
    case = make_case(
        [q_len],
        [prefix],
        num_kv_heads=NUM_KV_HEADS,
        group=group,
        head_dim=HEAD_DIM,
        block_size=block_size,
    )
    assert_close(run_prefill(case), oracle(case))


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefill_of_a_mixed_length_batch_equals_each_sequence_alone(block_size):
    case = make_case(
        [17, 1, 5, 33, 2], [0, 40, 1, 16, 0],
        num_kv_heads=NUM_KV_HEADS, group=3, head_dim=HEAD_DIM, block_size=block_size, seed=1,
    )  # fmt: skip
    assert_close(run_prefill(case), oracle(case))


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("ctx", LENGTHS)
def test_decode_equals_dense_attention_over_the_whole_context(ctx, block_size, group):
    # A mixed batch: the sequence under test beside a short and a 1-token one.
    case = make_case(
        [1, 1, 1], [ctx - 1, 4, 0],
        num_kv_heads=NUM_KV_HEADS, group=group, head_dim=HEAD_DIM, block_size=block_size, seed=2,
    )  # fmt: skip
    assert_close(run_decode(case), oracle(case))


def test_decode_ignores_never_written_slots_holding_nan():
    # Sequence 1 ends mid-block and its table row is padded with -1: the NaN in the rest of
    # its last block and in the padding must not reach its output.
    case = make_case(
        [1, 1], [40, 2], num_kv_heads=1, group=2, head_dim=HEAD_DIM, block_size=16, seed=3
    )
    assert torch.isnan(case.k_cache).any() and (case.block_tables[1] == -1).any()
    out = run_decode(case)
    assert torch.isfinite(out).all()
    assert_close(out, oracle(case))


def test_store_kv_places_every_token_at_its_slot():
    block_size, hkv, d = 4, 2, 8
    key, value = torch.randn(6, hkv, d), torch.randn(6, hkv, d)
    k_cache, v_cache = torch.zeros(5, block_size, hkv, d), torch.zeros(5, block_size, hkv, d)
    slots = torch.tensor([19, 0, 7, 8, 3, 12])
    ReferenceBackend().store_kv(key, value, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // block_size, slot % block_size], key[t])
        assert torch.equal(v_cache[slot // block_size, slot % block_size], value[t])
    assert int((k_cache.abs().sum(dim=(2, 3)) > 0).sum()) == len(slots)


def test_store_kv_skips_negative_slots():
    key, value = torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    ReferenceBackend().store_kv(key, value, k_cache, v_cache, torch.tensor([-1, 5, -1, 2]))
    flat_k, flat_v = k_cache.view(-1, 1, 8), v_cache.view(-1, 1, 8)
    assert torch.equal(flat_k[5], key[1]) and torch.equal(flat_k[2], key[3])
    assert torch.equal(flat_v[5], value[1]) and torch.equal(flat_v[2], value[3])
    written = flat_k.abs().sum(dim=(1, 2)) > 0
    assert written.nonzero().flatten().tolist() == [2, 5]
