"""The Triton kernels equal the PyTorch reference on the grid: lengths 1/17/1025, cached prefix
none/one token/several blocks, page sizes 1 and 16, GQA 1/3/8, head sizes 64 and 128, mixed
batches, shuffled block tables whose unused slots hold NaN.

Without a CUDA GPU the kernels run on CPU tensors in Triton's interpreter. Triton picks
interpreted-or-compiled when each `@triton.jit` is applied, `triton.language`'s own helpers
included, so TRITON_INTERPRET must be set before this process first imports triton: we set it
here, at import, before `import triton`. A subprocess per case would pay torch + triton start-up
each time and hide the per-case report; and the variable leaking into the rest of the session
changes nothing another module could do, since without CUDA compiled Triton cannot run at all.
With a GPU the variable is left alone, and the same grid runs compiled on CUDA.

Tolerances (kernel vs reference in float32 on the same rounded inputs), atol / rtol:
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
from pdserve.kernels.triton_decode import MAX_SPLITS, _decode_split_kernel  # noqa: E402
from pdserve.kernels.triton_launch import is_interpreted  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
TOLERANCES = {  # (atol, rtol)
    torch.float32: (2e-5, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
NUM_KV_HEADS = 2  # two, so that the query-head -> KV-head mapping is exercised
PREFIXES = ["none", "one token", "several blocks"]
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True, scope="module")
def _triton_can_run_here():
    if DEVICE.type == "cpu" and not is_interpreted(_decode_split_kernel):
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on "
            "the CPU: run this module alone or export TRITON_INTERPRET=1 for the test run"
        )


def prefix_tokens(kind: str, block_size: int) -> int:
    """0, 1, or three and a half blocks (the last one partly filled)."""
    return {"none": 0, "one token": 1, "several blocks": 3 * block_size + block_size // 2 + 1}[kind]


def case_for(q_lens, prefix_lens, *, group, head_dim, block_size, dtype=torch.float32, seed=0,
             num_kv_heads=NUM_KV_HEADS, device=DEVICE) -> PagedCase:  # fmt: skip
    return make_case(
        q_lens, prefix_lens, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
        block_size=block_size, dtype=dtype, device=device, seed=seed,
    )  # fmt: skip


def prefill(backend, case: PagedCase) -> torch.Tensor:
    return backend.prefill_attention(
        case.q, case.key, case.value, case.k_cache, case.v_cache,
        case.cu_seqlens_q, case.seq_lens, case.block_tables, case.scale,
    )  # fmt: skip


def decode(backend, case: PagedCase) -> torch.Tensor:
    return backend.decode_attention(
        case.decode_q, case.k_cache, case.v_cache, case.seq_lens, case.block_tables, case.scale
    )


def assert_matches_reference(op, case: PagedCase, backend=None) -> None:
    """`op` through Triton in the case's dtype vs the reference in float32 on the same values."""
    actual = op(backend or TritonBackend(), case)
    expected = op(ReferenceBackend(), case.to(torch.float32))
    assert actual.dtype == case.q.dtype and actual.shape == case.q.shape
    atol, rtol = TOLERANCES[case.q.dtype]
    torch.testing.assert_close(actual.float(), expected, atol=atol, rtol=rtol)


# ---------------------------------------------------------------- store_kv


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16])
def test_store_kv_writes_what_the_reference_writes(block_size, head_dim, dtype):
    num_tokens, num_blocks = 37, 64 // block_size
    gen = torch.Generator().manual_seed(block_size + head_dim)
    key = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens: skipped
    caches = []
    for backend in (TritonBackend(), ReferenceBackend()):
        k_cache = torch.zeros(
            num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype=dtype, device=DEVICE
        )
        v_cache = torch.zeros_like(k_cache)
        backend.store_kv(key, value, k_cache, v_cache, slots.to(DEVICE))
        caches.append((k_cache, v_cache))
    (k_triton, v_triton), (k_ref, v_ref) = caches
    assert torch.equal(k_triton, k_ref) and torch.equal(v_triton, v_ref)


def test_store_kv_casts_to_the_cache_dtype_and_skips_negative_slots():
    # float16, not bfloat16: Triton 3.9's interpreter truncates fp32 -> bf16 where torch and the
    # GPU round to nearest even, so a bf16 cache written on the CPU can differ by one ulp.
    key = torch.randn(4, 1, 16, device=DEVICE)
    value = torch.randn(4, 1, 16, device=DEVICE)
    k_cache = torch.zeros(2, 4, 1, 16, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    TritonBackend().store_kv(
        key, value, k_cache, v_cache, torch.tensor([-1, 5, -1, 2], device=DEVICE)
    )
    flat_k, flat_v = k_cache.view(-1, 1, 16), v_cache.view(-1, 1, 16)
    assert torch.equal(flat_k[5], key[1].half()) and torch.equal(flat_k[2], key[3].half())
    assert torch.equal(flat_v[5], value[1].half()) and torch.equal(flat_v[2], value[3].half())
    assert (flat_k.abs().sum(dim=(1, 2)) > 0).nonzero().flatten().tolist() == [2, 5]


# ---------------------------------------------------------------- prefill


# Page size and head size meet in no shared code path (paging is per-token address arithmetic),
# so under the interpreter head size 128 is crossed with page size 16 only; the GPU grid below
# is the full product.
@pytest.mark.parametrize(("block_size", "head_dim"), [(1, 64), (16, 64), (16, 128)])
@pytest.mark.parametrize("prefix_kind", PREFIXES)
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("q_len", [1, 17])
def test_prefill_matches_reference(q_len, group, prefix_kind, block_size, head_dim):
    prefix = prefix_tokens(prefix_kind, block_size)
    case = case_for([q_len], [prefix], group=group, head_dim=head_dim, block_size=block_size)
    assert_matches_reference(prefill, case)


@pytest.mark.parametrize(
    ("q_len", "prefix", "block_size", "group", "num_kv_heads"),
    [
        (1025, 0, 16, 1, 1),  # many query tiles, causal diagonal in each
        (17, 1008, 16, 3, 2),  # a late chunk of a 1025-token prompt: long paged prefix
        (1, 1024, 1, 8, 1),  # one token over a page-size-1 prefix
    ],
)
def test_prefill_of_1025_tokens_matches_reference(q_len, prefix, block_size, group, num_kv_heads):
    case = case_for(
        [q_len],
        [prefix],
        group=group,
        head_dim=64,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
    )
    assert_matches_reference(prefill, case)


@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_of_a_mixed_length_batch_matches_reference(block_size):
    case = case_for(
        [17, 1, 5, 70, 2], [0, 40, 1, 16, 0], group=3, head_dim=64, block_size=block_size, seed=1
    )
    assert_matches_reference(prefill, case)


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("ctx", [1, 17, 1025])
def test_decode_matches_reference(ctx, block_size, group, head_dim):
    # The sequence under test beside a short one: mixed lengths, padded table rows.
    case = case_for(
        [1, 1], [ctx - 1, 4], group=group, head_dim=head_dim, block_size=block_size, seed=2
    )
    assert_matches_reference(decode, case)


@pytest.mark.parametrize("splits", [1, 3, MAX_SPLITS])
def test_decode_split_k_merge_matches_reference(splits):
    # 32 splits of a 1025-token context leave most splits of the short sequences empty.
    case = case_for([1, 1, 1], [1024, 63, 0], group=3, head_dim=64, block_size=16, seed=3)
    assert_matches_reference(decode, case, backend=TritonBackend(decode_splits=splits))


# ---------------------------------------------------------------- dtypes and head sizes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", [prefill, decode], ids=["prefill", "decode"])
def test_half_precision_matches_float32_reference(op, dtype):
    q_lens = [17, 1, 30] if op is prefill else [1, 1, 1]
    case = case_for(q_lens, [0, 33, 20], group=3, head_dim=64, block_size=16, dtype=dtype, seed=4)
    assert_matches_reference(op, case)


@pytest.mark.parametrize("head_dim", [16, 80])  # a tiny Llama's head; one padded to 128 by masks
@pytest.mark.parametrize("op", [prefill, decode], ids=["prefill", "decode"])
def test_small_and_non_power_of_two_head_sizes_match_reference(op, head_dim):
    q_lens = [9, 3] if op is prefill else [1, 1]
    case = case_for(q_lens, [20, 0], group=2, head_dim=head_dim, block_size=16, seed=5)
    assert_matches_reference(op, case)


# ---------------------------------------------------------------- validation


def test_rejects_an_unsupported_dtype_before_launch():
    case = case_for([1], [3], group=1, head_dim=16, block_size=16)
    with pytest.raises(ValueError, match="dtype"):
        TritonBackend().decode_attention(
            case.q.double(),
            case.k_cache,
            case.v_cache,
            case.seq_lens,
            case.block_tables,
            case.scale,
        )


def test_rejects_a_head_size_above_the_limit():
    q = torch.zeros(1, 1, 512, device=DEVICE)
    cache = torch.zeros(1, 16, 1, 512, device=DEVICE)
    lens, table = (
        torch.ones(1, dtype=torch.int32, device=DEVICE),
        torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
    )
    with pytest.raises(ValueError, match="head size"):
        TritonBackend().decode_attention(q, cache, cache, lens, table, 1.0)


def test_rejects_key_with_the_wrong_shape():
    case = case_for([4], [0], group=2, head_dim=16, block_size=16)
    with pytest.raises(ValueError, match="key must be"):
        TritonBackend().prefill_attention(
            case.q, case.key[:2], case.value, case.k_cache, case.v_cache,
            case.cu_seqlens_q, case.seq_lens, case.block_tables, case.scale,
        )  # fmt: skip


def test_rejects_seq_lens_that_do_not_match_the_batch():
    case = case_for([1, 1], [3, 4], group=1, head_dim=16, block_size=16)
    with pytest.raises(ValueError, match="seq_lens"):
        TritonBackend().decode_attention(
            case.q, case.k_cache, case.v_cache, case.seq_lens[:1], case.block_tables, case.scale
        )


def test_rejects_an_out_of_range_split_count():
    with pytest.raises(ValueError, match="decode_splits"):
        TritonBackend(decode_splits=0)


# ---------------------------------------------------------------- full size on a GPU


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("prefix_kind", PREFIXES)
@pytest.mark.parametrize("q_len", [1, 17, 1025])
def test_gpu_prefill_full_grid_matches_reference(
    q_len, prefix_kind, block_size, group, head_dim, dtype
):
    prefix = prefix_tokens(prefix_kind, block_size)
    # The sequence under test in a mixed batch of 8 KV heads.
    case = case_for(
        [q_len, 5, 33], [prefix, 100, 0], group=group, head_dim=head_dim, block_size=block_size,
        dtype=dtype, num_kv_heads=8, device="cuda",
    )  # fmt: skip
    assert_matches_reference(prefill, case)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("ctx", [1, 17, 1025, 4097])
def test_gpu_decode_full_grid_matches_reference(ctx, block_size, group, head_dim, dtype):
    case = case_for(
        [1] * 6, [ctx - 1, 0, 16, 17, 300, 1024], group=group, head_dim=head_dim,
        block_size=block_size, dtype=dtype, num_kv_heads=8, device="cuda",
    )  # fmt: skip
    assert_matches_reference(decode, case)
