"""Sliding-window attention (kernels/interface.py): a query at position p sees keys p-W+1 .. p.

The reference backend against a dense float64 masked softmax, and the compiled CPU kernels
(cpu_attention.cpp, cpu_prefill.cpp, cpu_prefill_tiles.cpp) against both: windows of 1, below a
block (5 in blocks of 16), a block, not a multiple of one (37), and past the context (no window);
decode over batches of different lengths, prefill with and without a cached prefix; GQA groups
1, 3 and 8; head sizes 64 and 128 (and 48, 24 where the tiles do not run); float32 within 1e-5,
bfloat16 within its rounding. Blocks wholly before a window are not read: they may be freed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.kernels.cpu_backend import CpuBackend
from pdserve.kernels.reference import ReferenceBackend, window_first_block
from pdserve.kernels.testing import PagedCase, make_case
from tests.kernels.test_reference import oracle

WINDOWS = [1, 5, 16, 37, 100_000]
F32 = {"atol": 1e-5, "rtol": 1e-5}
BF16 = {"atol": 2e-2, "rtol": 2e-2}
DECODE_LENS = [1, 4, 5, 6, 16, 17, 37, 38, 100, 300]


@pytest.fixture(scope="module")
def backend(ops) -> CpuBackend:
    return CpuBackend(ops)


def decode_case(ctx_lens, *, group, head_dim, block_size, dtype=torch.float32, seed=0) -> PagedCase:
    return make_case([1] * len(ctx_lens), [c - 1 for c in ctx_lens], num_kv_heads=2, group=group,
                     head_dim=head_dim, block_size=block_size, dtype=dtype, seed=seed)


def decode(backend, case: PagedCase, window: int) -> torch.Tensor:
    return backend.decode_attention(case.decode_q, case.k_cache, case.v_cache, case.seq_lens, case.block_tables,
                                    case.scale, window=window)


def prefill(backend, case: PagedCase, window: int) -> torch.Tensor:
    return backend.prefill_attention(case.q, case.key, case.value, case.k_cache, case.v_cache, case.cu_seqlens_q,
                                     case.seq_lens, case.block_tables, case.scale, window=window)


def free_blocks_before_windows(case: PagedCase, window: int, first_rows: list[int]) -> PagedCase:
    """The case with every block wholly before the window of sequence b's row at position
    first_rows[b] dropped from its table (-1) and poisoned with NaN in the cache, as an engine
    that frees a local layer's old blocks leaves them."""
    tables, k_cache, v_cache = case.block_tables.clone(), case.k_cache.clone(), case.v_cache.clone()
    block_size = k_cache.shape[1]
    for b, pos in enumerate(first_rows):
        cut = window_first_block(pos + 1, window, block_size)
        for j in range(cut):
            k_cache[tables[b, j]] = float("nan")
            v_cache[tables[b, j]] = float("nan")
            tables[b, j] = -1
    return dataclasses.replace(case, block_tables=tables, k_cache=k_cache, v_cache=v_cache)


# --- the reference against the dense oracle ---


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_reference_decode_is_dense_attention_over_the_last_window_positions(window, block_size, group):
    case = decode_case(DECODE_LENS, group=group, head_dim=16, block_size=block_size, seed=window)
    torch.testing.assert_close(decode(ReferenceBackend(), case, window).double(), oracle(case, window), **F32)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("prefixes", [[0, 0, 0, 0], [3, 40, 100, 0]], ids=["no prefix", "cached prefix"])
def test_reference_prefill_is_dense_windowed_attention(window, block_size, prefixes):
    case = make_case([1, 17, 70, 40], prefixes, num_kv_heads=2, group=3, head_dim=16, block_size=block_size,
                     seed=window + block_size)
    torch.testing.assert_close(prefill(ReferenceBackend(), case, window).double(), oracle(case, window), **F32)


def test_reference_prefill_of_one_prompt_is_dense_windowed_attention():
    """One prompt without a prefix: the step's own keys, through SDPA with the window's mask."""
    case = make_case([50], [0], num_kv_heads=2, group=2, head_dim=16, block_size=16, seed=4)
    torch.testing.assert_close(prefill(ReferenceBackend(), case, 7).double(), oracle(case, 7), **F32)


def test_a_negative_window_is_refused():
    case = decode_case([4], group=1, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match="sliding window"):
        decode(ReferenceBackend(), case, -1)
    with pytest.raises(ValueError, match="sliding window"):
        prefill(ReferenceBackend(), case, -3)


# --- the compiled kernels ---


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (8, 64), (2, 128), (3, 128), (3, 12)])
def test_compiled_decode_equals_dense_windowed_attention_in_float32(backend, window, group, head_dim):
    case = decode_case(DECODE_LENS, group=group, head_dim=head_dim, block_size=16, seed=group + window)
    out = decode(backend, case, window)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), oracle(case, window), **F32)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [7, 16])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (8, 64), (2, 128), (4, 128), (3, 48)])
def test_compiled_decode_in_bfloat16_is_the_reference_within_its_rounding(backend, window, block_size, group, head_dim):
    """bfloat16 scores on AMX tiles, two positions a vector (head sizes 64, 128) or one (48, and the
    groups too large for pairs), tiles starting mid-block where the window does."""
    case = decode_case(DECODE_LENS, group=group, head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16,
                       seed=block_size + group)
    out = decode(backend, case, window)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    torch.testing.assert_close(out.float(), decode(ReferenceBackend(), case, window).float(), **BF16)
    torch.testing.assert_close(out.double(), oracle(case, window).to(out.dtype).double(), **BF16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [5, 16, 37])
def test_decode_never_reads_the_blocks_before_the_window(backend, dtype, window):
    """Blocks before each sequence's window dropped from its table (-1) and NaN in the cache: both
    backends give the same answer as with them, the compiled one the same bits."""
    case = decode_case(DECODE_LENS, group=3, head_dim=64, block_size=16, dtype=dtype, seed=window)
    freed = free_blocks_before_windows(case, window, [n - 1 for n in DECODE_LENS])
    assert (freed.block_tables == -1).sum() > (case.block_tables == -1).sum()
    for attention in (backend, ReferenceBackend()):
        got = decode(attention, freed, window)
        assert not got.isnan().any()
        torch.testing.assert_close(got, decode(attention, case, window), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_window_over_the_whole_context_is_no_window_to_the_bit(backend, dtype):
    lens = [3, 17, 100]
    case = decode_case(lens, group=3, head_dim=64, block_size=16, dtype=dtype, seed=9)
    chunked = make_case([20, 64], [30, 0], num_kv_heads=2, group=3, head_dim=64, block_size=16, dtype=dtype, seed=9)
    for attention in (backend, ReferenceBackend()):
        assert torch.equal(decode(attention, case, 100), decode(attention, case, 0))
        assert torch.equal(prefill(attention, chunked, 64), prefill(attention, chunked, 0))


def prefill_case(group, head_dim, dtype, seed):
    """Prompts below, at and across the kernels' blocks (64 tokens, 48-row chunks, 32-row items,
    32-key steps), alone and over cached prefixes of several blocks."""
    return make_case([1, 5, 33, 64, 70, 130, 3], [0, 0, 17, 0, 40, 63, 300], num_kv_heads=2, group=group,
                     head_dim=head_dim, block_size=16, dtype=dtype, seed=seed)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (8, 128), (3, 24)])
def test_compiled_prefill_equals_dense_windowed_attention_in_float32(backend, window, group, head_dim):
    case = prefill_case(group, head_dim, torch.float32, seed=window + group)
    torch.testing.assert_close(prefill(backend, case, window).double(), oracle(case, window), **F32)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (3, 128), (8, 128), (3, 48)])
def test_compiled_prefill_in_bfloat16_is_windowed_attention_within_its_rounding(backend, window, group, head_dim):
    """Head sizes that are whole 32-wide steps run on the tiles (AMX, or VDPBF16PS register blocks,
    or the tiles' emulation: forced here on every CPU); 48 runs on SDPA with the window's mask."""
    tiles = CpuBackend(backend.ops)
    tiles.tiled_prefill = True
    assert tiles.compiles_prefill(torch.bfloat16, head_dim) == (head_dim % 32 == 0)
    case = prefill_case(group, head_dim, torch.bfloat16, seed=window + group)
    out = prefill(tiles, case, window)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), oracle(case, window).to(out.dtype).double(), **BF16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 37])
def test_compiled_prefill_over_a_long_prefix_is_the_op_over_the_windows_keys_alone(backend, dtype, window):
    """Keys before the first row's window change nothing: the op over 1,000 cached keys and 40 new
    rows gives the bits it gives over only the keys from that row's first one on."""
    g = torch.Generator().manual_seed(window)
    q = torch.randn(40, 6, 64, generator=g).to(dtype)
    k, v = (torch.randn(1040, 2, 64, generator=g).to(dtype) for _ in range(2))
    first = 1000 - window + 1
    full = backend.ops.prefill_attention(q, k, v, 1000, 0.125, window)
    alone = backend.ops.prefill_attention(q, k[first:], v[first:], 1000 - first, 0.125, window)
    assert torch.equal(full, alone)
    tol = F32 if dtype == torch.float32 else BF16
    expected = ReferenceBackend().causal_attention(q, k, v, 1000, 0.125, window)
    torch.testing.assert_close(full.float(), expected.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_over_a_prefix_never_reads_the_blocks_before_the_first_rows_window(backend, dtype):
    window = 20
    case = make_case([5, 30], [70, 45], num_kv_heads=2, group=3, head_dim=64, block_size=16, dtype=dtype, seed=2)
    freed = free_blocks_before_windows(case, window, case.prefix_lens)
    assert (freed.block_tables == -1).sum() > (case.block_tables == -1).sum()
    for attention in (backend, ReferenceBackend()):
        got = prefill(attention, freed, window)
        assert not got.isnan().any()
        torch.testing.assert_close(got, prefill(attention, case, window), atol=0, rtol=0)


def test_the_compiled_ops_refuse_a_negative_window(backend):
    case = decode_case([4], group=1, head_dim=16, block_size=4)
    with pytest.raises(RuntimeError, match="window"):
        backend.ops.decode_attention(case.q, case.k_cache, case.v_cache, case.seq_lens, case.block_tables, 0.25, -1)
    with pytest.raises(RuntimeError, match="window"):
        backend.ops.prefill_attention(case.q, case.key, case.value, 0, 0.25, -1)


# --- which blocks a window still needs ---


@pytest.mark.parametrize(("seq_len", "window", "block_size", "first"), [
    (100, 0, 16, 0),  # no window: every block
    (5, 5, 16, 0),  # the window covers the sequence
    (16, 5, 16, 0),  # positions 11..15, block 0
    (21, 5, 16, 1),  # positions 16..20, block 1 alone
    (20, 5, 16, 0),  # positions 15..19: the last of block 0 too
    (100, 37, 16, 3),  # positions 63..99
    (100, 1, 16, 6),  # position 99
    (100, 1, 1, 99),
])
def test_window_first_block_is_the_block_of_the_last_querys_first_key(seq_len, window, block_size, first):
    assert window_first_block(seq_len, window, block_size) == first


@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_decode_needs_no_block_before_window_first_block(window):
    """Against the dense mask: every key the last query of a sequence sees lies in or after it."""
    for seq_len in range(1, 120):
        first = window_first_block(seq_len, window, 16)
        seen = [k for k in range(seq_len) if k > seq_len - 1 - window]
        assert min(seen) // 16 == first
