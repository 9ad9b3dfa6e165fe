"""Sliding-window attention in the Triton kernels equals a dense masked softmax written here,
and the reference backend's.

A query at position p sees keys p-W < k <= p (transformers' `kv_idx > q_idx - sliding_window`);
window 0 is plain causal attention. The grid: windows of one key, smaller than a page (5 < 16),
not a multiple of anything (37), and longer than every context; contexts that leave whole KV
tiles (64 keys) before the window; mixed batches; prefill with and without a cached prefix; GQA.
Keys before each sequence's earliest window are overwritten with NaN, and table entries of pages
wholly before it point at a NaN page, as if freed: a kernel that reads them fails.

TRITON_INTERPRET is set before triton is first imported, as in test_triton.py (see its docstring).
Tolerances as there, kernel vs a float64 oracle on the same rounded inputs, atol / rtol:
float32 2e-5 / 1e-4, float16 5e-3 / 5e-3, bfloat16 2e-2 / 2e-2.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from pdserve.kernels.reference import ReferenceBackend  # noqa: E402
from pdserve.kernels.testing import PagedCase, make_case  # noqa: E402
from pdserve.kernels.triton_backend import TritonBackend  # noqa: E402
from pdserve.kernels.triton_decode import _decode_split_kernel  # noqa: E402
from pdserve.kernels.triton_launch import is_interpreted  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCES = {  # (atol, rtol)
    torch.float32: (2e-5, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
NUM_KV_HEADS = 2
HEAD_DIM = 32  # small: the interpreter's cost grows with the tile sizes
BLOCK = 16
WINDOWS = [1, 5, 37, 10_000]  # one key, under a page, odd, longer than any context


@pytest.fixture(autouse=True, scope="module")
def _triton_can_run_here():
    if DEVICE.type == "cpu" and not is_interpreted(_decode_split_kernel):
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on "
            "the CPU: run this module alone or export TRITON_INTERPRET=1 for the test run"
        )


def windowed_case(q_lens, prefix_lens, *, window, group, block_size=BLOCK, dtype=torch.float32,
                  seed=0) -> PagedCase:  # fmt: skip
    """A paged case in which nothing before any query's window can be read without NaN."""
    case = make_case(
        q_lens, prefix_lens, num_kv_heads=NUM_KV_HEADS, group=group, head_dim=HEAD_DIM,
        block_size=block_size, dtype=dtype, device=DEVICE, seed=seed,
    )  # fmt: skip
    used = set(case.block_tables.flatten().tolist())
    nan_page = next(n for n in range(case.k_cache.shape[0]) if n not in used)  # a spare page
    for b, prefix in enumerate(prefix_lens):
        first_needed = max(prefix + 1 - window, 0) if window else 0  # the first query's window
        pages, rows = case.block_tables[b].long(), torch.arange(first_needed, device=DEVICE)
        for cache in (case.k_cache, case.v_cache):
            cache[pages[rows // block_size], rows % block_size] = float("nan")
        case.block_tables[b, : first_needed // block_size] = nan_page
    return case


def dense_attention(case: PagedCase, window: int) -> torch.Tensor:
    """The oracle: per sequence, full [Hq, q_len, ctx] scores, masked, softmax, in float64."""
    outs = []
    for b, (n, prefix) in enumerate(zip(case.q_lens, case.prefix_lens, strict=True)):
        start = int(case.cu_seqlens_q[b])
        q = case.q[start : start + n].double().transpose(0, 1)  # [Hq, n, D]
        group = q.shape[0] // NUM_KV_HEADS
        k = case.dense_k[b].double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, ctx, D]
        v = case.dense_v[b].double().repeat_interleave(group, dim=1).transpose(0, 1)
        query_pos = torch.arange(prefix, prefix + n, device=q.device)[:, None]
        key_pos = torch.arange(prefix + n, device=q.device)[None, :]
        visible = key_pos <= query_pos
        if window > 0:
            visible &= key_pos > query_pos - window
        scores = (q @ k.transpose(1, 2)) * case.scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        outs.append((probs @ v).transpose(0, 1))  # [n, Hq, D]
    return torch.cat(outs)


def prefill(backend, case: PagedCase, window: int) -> torch.Tensor:
    return backend.prefill_attention(
        case.q, case.key, case.value, case.k_cache, case.v_cache,
        case.cu_seqlens_q, case.seq_lens, case.block_tables, case.scale, window=window,
    )  # fmt: skip


def decode(backend, case: PagedCase, window: int) -> torch.Tensor:
    return backend.decode_attention(
        case.decode_q, case.k_cache, case.v_cache, case.seq_lens, case.block_tables, case.scale,
        window=window,
    )  # fmt: skip


def assert_matches_dense(actual: torch.Tensor, case: PagedCase, window: int) -> None:
    assert actual.dtype == case.q.dtype and actual.shape == case.q.shape
    atol, rtol = TOLERANCES[case.q.dtype]
    expected = dense_attention(case, window).float()
    torch.testing.assert_close(actual.float(), expected, atol=atol, rtol=rtol)


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize("splits", [None, 3], ids=["auto-splits", "3-splits"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", WINDOWS)
def test_decode_attends_to_the_last_window_keys(window, group, splits):
    # Contexts of 1 key, under a page, a page and one, past one KV tile, past three.
    prefixes = [0, 4, 16, 69, 199]
    case = windowed_case([1] * len(prefixes), prefixes, window=window, group=group, seed=window)
    actual = decode(TritonBackend(decode_splits=splits), case, window)
    assert_matches_dense(actual, case, window)


@pytest.mark.parametrize("window", [5, 37])
def test_decode_window_with_page_size_one(window):
    case = windowed_case([1, 1], [90, 3], window=window, group=2, block_size=1, seed=7)
    assert_matches_dense(decode(TritonBackend(), case, window), case, window)


# ---------------------------------------------------------------- prefill


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", WINDOWS)
def test_prefill_rows_attend_to_their_last_window_keys(window, group):
    # No prefix; a prefix over pages; three query tiles (BLOCK_M 64), the last past a whole key
    # tile; a chunk whose later query tile needs no cached key at all.
    q_lens, prefixes = [1, 17, 130, 70], [0, 40, 0, 70]
    case = windowed_case(q_lens, prefixes, window=window, group=group, seed=10 + window)
    assert_matches_dense(prefill(TritonBackend(), case, window), case, window)


@pytest.mark.parametrize("window", [5, 37])
def test_prefill_window_with_page_size_one(window):
    case = windowed_case([20, 3], [50, 0], window=window, group=2, block_size=1, seed=8)
    assert_matches_dense(prefill(TritonBackend(), case, window), case, window)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("op", [prefill, decode], ids=["prefill", "decode"])
def test_window_agrees_with_the_reference_backend(op, window):
    # The same semantics as the CPU oracle, on an unpoisoned case (what each reads is its own).
    q_lens = [1, 17, 70] if op is prefill else [1, 1, 1]
    case = make_case(q_lens, [0, 40, 70], num_kv_heads=NUM_KV_HEADS, group=3, head_dim=HEAD_DIM,
                     block_size=BLOCK, device=DEVICE, seed=12)  # fmt: skip
    expected = op(ReferenceBackend(), case, window)
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(op(TritonBackend(), case, window), expected, atol=atol, rtol=rtol)


# ---------------------------------------------------------------- dtypes, window 0, validation


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", [prefill, decode], ids=["prefill", "decode"])
def test_half_precision_window_matches_dense(op, dtype):
    q_lens = [17, 70] if op is prefill else [1, 1]
    case = windowed_case(q_lens, [40, 70], window=37, group=3, dtype=dtype, seed=9)
    assert_matches_dense(op(TritonBackend(), case, 37), case, 37)


@pytest.mark.parametrize("op", [prefill, decode], ids=["prefill", "decode"])
def test_window_zero_is_the_causal_default(op):
    q_lens = [17, 70] if op is prefill else [1, 1]
    case = windowed_case(q_lens, [40, 70], window=0, group=3, seed=11)
    backend = TritonBackend()
    paged = (case.k_cache, case.v_cache)
    tables = (case.seq_lens, case.block_tables)
    if op is prefill:  # no window argument at all
        default = backend.prefill_attention(
            case.q, case.key, case.value, *paged, case.cu_seqlens_q, *tables, case.scale
        )
    else:
        default = backend.decode_attention(case.q, *paged, *tables, case.scale)
    assert torch.equal(op(backend, case, 0), default)
    assert_matches_dense(default, case, 0)


@pytest.mark.parametrize("window", [-1, 2.5, True])
@pytest.mark.parametrize("op", [prefill, decode], ids=["prefill", "decode"])
def test_rejects_a_window_that_is_not_a_non_negative_int(op, window):
    q_lens = [3] if op is prefill else [1]
    case = make_case(q_lens, [4], num_kv_heads=1, group=1, head_dim=16, block_size=16,
                     device=DEVICE)  # fmt: skip
    with pytest.raises(ValueError, match="window"):
        op(TritonBackend(), case, window)
