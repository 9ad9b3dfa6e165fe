"""The compiled CPU backend (kernels/csrc/cpu_attention.cpp, cpu_prefill.cpp) against the dense float64 oracle and
the PyTorch reference: odd lengths, page sizes 1/7/16, GQA groups on the vectorised paths (1-8)
and past them (9), head sizes that are and are not a multiple of 8 (and, on AVX-512, of 16 and
32: attention_avx512.h; bfloat16 scores on AMX tiles where the CPU has AMX, over tiles of 16
positions read in place or, across small pages and at the tail, copied; with AVX512-BF16, two
positions a vector for head sizes 64 and 128 and the weighted sum on rounded probabilities, odd
lengths included), shuffled tables padded with
-1 over caches whose unused slots hold NaN, float32 and bfloat16, strided q as the model passes
it. Bad tables raise instead of reading outside the cache. The build itself, its cache key and
the fallback to the reference when it cannot build are tested too."""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.kernels import cpu_ops
from pdserve.kernels.backends import get_backend
from pdserve.kernels.cpu_backend import CpuBackend
from pdserve.kernels.reference import ReferenceBackend
from pdserve.kernels.testing import make_case
from tests.helpers.engine_runs import StepRecorder, greedy_tokens
from tests.kernels.test_reference import oracle, run_prefill


@pytest.fixture(scope="module")
def backend(ops) -> CpuBackend:
    return CpuBackend(ops)


def decode_case(ctx_lens, *, group, head_dim, block_size, num_kv_heads=2, dtype=torch.float32, seed=0):
    return make_case([1] * len(ctx_lens), [c - 1 for c in ctx_lens], num_kv_heads=num_kv_heads, group=group,
                     head_dim=head_dim, block_size=block_size, dtype=dtype, seed=seed)


def run(backend, case):
    return backend.decode_attention(case.decode_q, case.k_cache, case.v_cache, case.seq_lens, case.block_tables, case.scale)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8, 9])
@pytest.mark.parametrize("head_dim", [16, 64, 12])
def test_decode_equals_dense_attention(backend, group, head_dim):
    case = decode_case([1, 2, 17, 33, 300], group=group, head_dim=head_dim, block_size=16, seed=group)
    torch.testing.assert_close(run(backend, case).double(), oracle(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize("ctx", [1, 8, 9, 1025])
def test_decode_over_page_sizes_and_lengths(backend, block_size, ctx):
    case = decode_case([ctx, max(1, ctx // 3)], group=3, head_dim=64, block_size=block_size, seed=ctx)
    out = run(backend, case)
    assert not out.isnan().any(), "read a NaN slot outside a sequence's tokens"
    torch.testing.assert_close(out.double(), oracle(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_a_sequence_gives_the_same_bits_alone_or_in_a_batch_on_one_or_two_threads(backend, dtype, head_dim):
    """A work item is a whole sequence (every KV head of a slot in one pass, on AVX-512 CPUs; one
    item per KV head elsewhere), so how the batch is split between threads never changes a
    sequence's answer: each one alone, on two threads, gives the bits it gives in a batch of 12 on
    one thread, and all are attention within the dtype's rounding."""
    lens = [1, 2, 15, 16, 17, 31, 33, 64, 100, 129, 257, 300]
    case = decode_case(lens, group=3, head_dim=head_dim, block_size=16, num_kv_heads=3, dtype=dtype, seed=11)
    threads = torch.get_num_threads()
    q = case.decode_q
    try:
        torch.set_num_threads(1)
        batch = run(backend, case)
        torch.set_num_threads(2)
        alone = torch.cat([
            backend.decode_attention(q[i:i + 1], case.k_cache, case.v_cache, case.seq_lens[i:i + 1],
                                     case.block_tables[i:i + 1], case.scale)
            for i in range(len(lens))
        ])
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(alone, batch, atol=0, rtol=0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(batch.double(), oracle(case).to(batch.dtype).double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4, 7])  # 7: two calls of the paired scores at head size 64
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("block_size", [7, 16])
def test_a_prompts_rows_attending_as_decodes_give_each_row_its_bits_alone(backend, dtype, group, head_dim, block_size):
    """--deterministic's prompt rows: row t of a prompt is a sequence of length t + 1 over the
    prompt's block table, and consecutive rows share their keys (the kernel reuses the previous
    row's offsets and skips the prefetches of what it just read). Each row gets the bits it gets
    as a lone decode, on either thread count, and attention within the dtype's rounding."""
    rows = 70
    case = make_case([rows], [0], num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype,
                     seed=head_dim + group)  # one prompt of 70 rows, all of its KV in the cache
    q = case.q
    table = case.block_tables.expand(rows, -1).contiguous()
    lens = torch.arange(1, rows + 1, dtype=torch.int32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = backend.decode_attention(q, case.k_cache, case.v_cache, lens, table, case.scale)
        torch.set_num_threads(1)
        alone = torch.cat([backend.decode_attention(q[t:t + 1], case.k_cache, case.v_cache, lens[t:t + 1],
                                                    table[t:t + 1], case.scale) for t in range(rows)])
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(together, alone, atol=0, rtol=0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(together.double(), oracle(case).to(dtype).double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("group", [1, 3, 8, 9])
@pytest.mark.parametrize("head_dim", [16, 64, 12])  # widened to float32 / vdpbf16ps / 8-wide, on AVX-512
def test_bfloat16_matches_the_reference_within_its_precision(backend, group, head_dim):
    case = decode_case([5, 64, 257], group=group, head_dim=head_dim, block_size=16, dtype=torch.bfloat16)
    out = run(backend, case)
    assert out.dtype == torch.bfloat16
    expected = ReferenceBackend().decode_attention(case.decode_q, case.k_cache, case.v_cache, case.seq_lens,
                                                   case.block_tables, case.scale)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("block_size", [1, 7, 16, 32])
@pytest.mark.parametrize("group,head_dim", [(3, 64), (4, 64), (2, 128), (8, 128), (1, 32)])
def test_bfloat16_over_page_sizes_and_partial_tiles(backend, block_size, group, head_dim):
    """bfloat16 with d a multiple of 32, the scores AMX computes where the CPU has it: 16 positions
    evenly spaced within a page are read in place, a tile across pages (sizes 1 and 7, shuffled)
    or past the last position is copied and zero-padded; a sequence alone gives the bits it gives in
    the batch. The unused slots hold NaN: a read past a sequence's tokens would show."""
    lens = [1, 15, 16, 17, 100, 257, 2, 33]
    case = decode_case(lens, group=group, head_dim=head_dim, block_size=block_size, num_kv_heads=2,
                       dtype=torch.bfloat16, seed=block_size + group)
    out = run(backend, case)
    assert not out.isnan().any()
    expected = ReferenceBackend().decode_attention(case.decode_q, case.k_cache, case.v_cache, case.seq_lens,
                                                   case.block_tables, case.scale)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    one = backend.decode_attention(case.decode_q[4:5], case.k_cache, case.v_cache, case.seq_lens[4:5],
                                   case.block_tables[4:5], case.scale)
    torch.testing.assert_close(one, out[4:5], atol=0, rtol=0)


def test_strided_q_as_the_model_passes_it(backend):
    """The model's q is a view into the fused qkv projection: rows are strided, heads are not."""
    case = decode_case([3, 40], group=3, head_dim=64, block_size=16)
    q = case.decode_q
    packed = torch.cat([q.reshape(q.shape[0], -1), torch.randn(q.shape[0], 100)], dim=1)
    strided = packed[:, : q.shape[1] * q.shape[2]].view(q.shape)
    assert not strided.is_contiguous()
    out = backend.decode_attention(strided, case.k_cache, case.v_cache, case.seq_lens, case.block_tables, case.scale)
    torch.testing.assert_close(out.double(), oracle(case), atol=1e-5, rtol=1e-5)


def test_a_sequence_of_length_zero_gets_zeros(backend):
    case = decode_case([4, 4], group=2, head_dim=16, block_size=4)
    lens = case.seq_lens.clone()
    lens[1] = 0
    out = backend.decode_attention(case.decode_q, case.k_cache, case.v_cache, lens, case.block_tables, case.scale)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[0].double(), oracle(case)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", ["negative id", "id past the cache", "table too short"])
def test_a_bad_block_table_raises_instead_of_reading_out_of_bounds(backend, bad):
    case = decode_case([20, 5], group=2, head_dim=16, block_size=4)
    tables, lens = case.block_tables.clone(), case.seq_lens.clone()
    if bad == "negative id":
        tables[0, 1] = -1
    elif bad == "id past the cache":
        tables[1, 0] = case.k_cache.shape[0]
    else:
        lens[0] = 4 * tables.shape[1] + 1
    with pytest.raises(RuntimeError, match="block|table"):
        backend.decode_attention(case.decode_q, case.k_cache, case.v_cache, lens, tables, case.scale)


def test_other_dtypes_run_the_reference(backend):
    case = decode_case([3, 9], group=2, head_dim=16, block_size=4).to(torch.float16)
    out = run(backend, case)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), oracle(case), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [16, 24, 64])
def test_compiled_prefill_equals_dense_attention(backend, group, head_dim):
    """float32 prefill through the blocked panel products (cpu_prefill.cpp): whole prompts and
    prompts over a cached prefix, lengths below, at and across the 64-token blocks and their
    48-row chunks, packed in one step; head sizes below, at and past the 24-column panels."""
    case = make_case([1, 5, 64, 65, 130, 200, 3], [0, 0, 0, 17, 0, 63, 300], num_kv_heads=2, group=group,
                     head_dim=head_dim, block_size=16, seed=5)
    torch.testing.assert_close(run_prefill(case, backend).double(), oracle(case), atol=1e-5, rtol=1e-5)


def test_compiled_prefill_matches_sdpa_on_the_models_shapes(backend):
    """SmolLM2's shapes (9 query heads over 3 KV heads, D 64), 1,024 tokens, q, k and v strided views
    of one projection's output as the model passes them: the same as SDPA."""
    qkv = torch.randn(1024, (9 + 3 + 3) * 64)
    q, k, v = (t.view(1024, -1, 64) for t in qkv.split([9 * 64, 3 * 64, 3 * 64], dim=1))
    assert not k.is_contiguous()
    ours = backend.causal_attention(q, k, v, 0, 0.125)
    torch.testing.assert_close(ours, ReferenceBackend().causal_attention(q, k, v, 0, 0.125), atol=1e-5, rtol=1e-5)


def test_compiled_prefill_refuses_mismatched_keys_and_other_dtypes(backend):
    q, k = torch.randn(4, 6, 16), torch.randn(9, 2, 16)
    with pytest.raises(RuntimeError, match="expected 8 keys .*got 9"):
        backend.ops.prefill_attention(q, k, k, 4, 0.25)  # offset 4 + 4 queries is 8 keys, not 9
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        backend.ops.prefill_attention(q.half(), k[:4].half(), k[:4].half(), 0, 0.25)
    with pytest.raises(RuntimeError, match="q, key and value alike"):
        backend.ops.prefill_attention(q.bfloat16(), k[:4], k[:4], 0, 0.25)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        backend.ops.prefill_attention(q.bfloat16(), k[:4].bfloat16(), k[:4].bfloat16(), 0, 0.25)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        backend.ops.prefill_attention(torch.randn(4, 5, 16), k[:4], k[:4], 0, 0.25)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_bfloat16_prefill_on_tiles_is_attention_within_bfloat16_rounding(backend, group, head_dim):
    """bfloat16 prefill through the tile kernel (cpu_prefill_tiles.cpp; AMX where the CPU has it,
    else register blocks of VDPBF16PS where it has AVX512-BF16, else the tiles' emulation; head
    sizes of one, two, three and four 32-wide steps): whole prompts and prompts over a cached prefix, lengths below, at and
    across the 32-row chunks and 32-key steps, packed in one step, against the float64 oracle."""
    case = make_case([1, 5, 32, 33, 70, 3], [0, 0, 0, 17, 40, 100], num_kv_heads=2, group=group,
                     head_dim=head_dim, block_size=16, dtype=torch.bfloat16, seed=7)
    tiles = CpuBackend(backend.ops)
    tiles.tiled_prefill = True  # the kernel on this CPU too, emulated where it has no AMX or AVX512-BF16
    torch.testing.assert_close(run_prefill(case, tiles).double(), oracle(case), atol=2e-2, rtol=2e-2)


def test_bfloat16_prefill_on_tiles_matches_sdpa_on_the_models_shapes(backend):
    """SmolLM2's shapes, 300 tokens over a 40-token prefix, q, k and v strided views of one
    projection's output: within bfloat16 rounding of SDPA in bfloat16."""
    qkv = torch.randn(340, (9 + 3 + 3) * 64).bfloat16()
    q, k, v = (t.view(340, -1, 64) for t in qkv.split([9 * 64, 3 * 64, 3 * 64], dim=1))
    ours = backend.ops.prefill_attention(q[40:], k, v, 40, 0.125)
    sdpa = ReferenceBackend().causal_attention(q[40:], k, v, 40, 0.125)
    torch.testing.assert_close(ours.float(), sdpa.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("native", "head_dim", "tiles"), [(True, 64, True), (True, 16, False), (False, 64, False)])
def test_bfloat16_prefill_runs_on_tiles_only_where_they_run_natively(backend, monkeypatch, native, head_dim, tiles):
    """The tile kernel takes a bfloat16 prefill where the CPU runs the tiles natively (AMX or
    AVX512-BF16) and the head size is whole tile rows; elsewhere SDPA does."""
    case = make_case([20], [0], num_kv_heads=2, group=3, head_dim=head_dim, block_size=16, dtype=torch.bfloat16, seed=2)
    calls = []

    def tile_kernel(*args):
        calls.append(args)
        return backend.ops.prefill_attention(*args)

    patched = CpuBackend(backend.ops)
    patched.tiled_prefill = native
    monkeypatch.setattr(patched, "ops", type("Ops", (), {"prefill_attention": staticmethod(tile_kernel)})())
    out = run_prefill(case, patched)
    assert bool(calls) == tiles
    torch.testing.assert_close(out.double(), oracle(case).to(out.dtype).double(), atol=2e-2, rtol=2e-2)


def test_the_cpu_is_the_default_backend_on_cpu(monkeypatch):
    assert isinstance(get_backend("cpu"), CpuBackend)
    assert type(get_backend("cpu", "reference")) is ReferenceBackend


def test_a_failed_build_falls_back_to_the_reference_with_a_warning(monkeypatch, caplog):
    def broken(cache_dir):
        raise OSError("no C++ compiler")

    monkeypatch.setattr(cpu_ops, "_loaded", None)
    monkeypatch.setattr(cpu_ops, "installed_variants", lambda: [])  # a checkout: nothing prebuilt
    monkeypatch.setattr(cpu_ops, "_build_native", broken)
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels.cpu_ops"):
        assert type(get_backend("cpu")) is ReferenceBackend
    assert "no C++ compiler" in caplog.text
    with pytest.raises(RuntimeError, match="did not build"):
        get_backend("cpu", "cpu")
    monkeypatch.setattr(cpu_ops, "_loaded", None)
    with pytest.raises(RuntimeError, match="required"):
        cpu_ops.load(require=True)


def test_the_build_is_cached_per_cpu_and_source(monkeypatch, tmp_path):
    key = cpu_ops.build_key()
    monkeypatch.setattr(cpu_ops, "_cpu_signature", lambda: "model name: another CPU\nflags: sse2")
    assert cpu_ops.build_key() != key
    assert cpu_ops.native_build_dir(tmp_path).parent == tmp_path


# --- the fused elementwise ops (kernels/csrc/cpu_elementwise.cpp) against model/llama.py's PyTorch code ---


def eager_copy(module):
    """The same module with its compiled path off: the oracle."""
    import copy

    ops, module.fused = module.fused, None
    twin = copy.deepcopy(module)
    module.fused = ops
    return twin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_fused_rms_norm_equals_the_eager_one(backend, dtype, rows):
    from pdserve.model.llama import RMSNorm

    norm = RMSNorm(200, 1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    norm = norm.to(dtype)
    norm.fused = backend.ops
    x = (torch.randn(rows, 200) * 3).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(norm(x), eager_copy(norm)(x), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_add_rms_norm_is_the_residual_add_then_the_norm_to_the_bit(backend, dtype, rows):
    """x += y in place, rounded as torch's add rounds, and the norm of the sum: bit for bit what
    `x + y` then rms_norm give (H = 200: sixteen at a time and a tail), so fusing them changes no
    token; y's rows may be strided."""
    torch.manual_seed(rows)
    weight = torch.randn(200).to(dtype)
    x = (torch.randn(rows, 200) * 3).to(dtype)
    y = (torch.randn(rows, 300) * 3).to(dtype)[:, 50:250]
    want_sum = x + y
    want = backend.ops.rms_norm(want_sum, weight, 1e-5)
    got = backend.ops.add_rms_norm_(x, y, weight, 1e-5)
    assert torch.equal(x, want_sum) and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="y must be"):
        backend.ops.add_rms_norm_(x, y[:, :100], weight, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 49152), (32, 49152), (3, 17), (5, 1), (4, 33)])
def test_argmax_rows_is_torchs_first_maximum(backend, dtype, shape):
    """The index max(dim=-1).indices gives, on rows, vector tails, ties, -inf rows and NaN."""
    x = torch.randn(*shape).to(dtype)
    assert torch.equal(backend.ops.argmax_rows(x), x.max(dim=-1).indices)
    rows, n = shape
    x[0] = float("-inf")  # every element -inf: the first
    if rows > 1:
        x[1] = 0.5  # all tied: the first
        x[2 % rows, n // 2] = float("nan")  # a NaN wins, the first one
        x[2 % rows, n - 1] = float("nan")
        x[-1, n - 1] = x[-1].max() + 1  # the maximum in the tail past the last full vector
    assert torch.equal(backend.ops.argmax_rows(x), x.max(dim=-1).indices)
    strided = torch.randn(rows, 2 * n).to(dtype)[:, ::2]
    with pytest.raises(RuntimeError, match="contiguous rows"):
        backend.ops.argmax_rows(strided)


def test_argmax_rows_refuses_other_dtypes(backend):
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        backend.ops.argmax_rows(torch.randn(2, 8, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_mul_equals_the_eager_mlp_activation(backend, dtype):
    gate_up = torch.cat([torch.randn(9, 37) * 4, torch.randn(9, 37)], dim=1)
    gate_up[0, :6] = torch.tensor([-100.0, -30.0, 0.0, 30.0, 100.0, 1e-3])  # the tails of the sigmoid
    gate_up = gate_up.to(dtype)
    out = backend.ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, **tol)
    assert out.isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rotary_equals_the_eager_one_in_place_on_strided_views(backend, dtype):
    from pdserve.model.config import ModelConfig
    from pdserve.model.llama import RotaryEmbedding

    cfg = ModelConfig(architecture="llama", vocab_size=10, hidden_size=48, intermediate_size=8, num_layers=1,
                      num_heads=3, num_kv_heads=1, head_dim=16)
    rotary = RotaryEmbedding(cfg, max_positions=64)
    rotary.fused = backend.ops
    qkv = torch.randn(7, (3 + 2) * 16).to(dtype)  # as the fused projection lays q, k, v out
    positions = torch.tensor([0, 1, 5, 9, 33, 62, 63])
    q, k, v = qkv.split((48, 16, 16), dim=-1)
    q, k = q.view(7, 3, 16), k.view(7, 1, 16)
    want_q, want_k = eager_copy(rotary)(positions, q.clone(), k.clone())
    v_before = v.clone()
    got_q, got_k = rotary(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr(), "rotates in place"
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
    assert torch.equal(v, v_before)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        rotary(torch.tensor([0, 1, 2, 3, 4, 5, 64]), q, k)


def test_fused_ops_refuse_other_dtypes(backend):
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        backend.ops.silu_mul(torch.randn(2, 8, dtype=torch.float64))


def test_the_engine_gives_the_same_greedy_tokens_with_and_without_the_fused_ops(tiny, monkeypatch):
    from pdserve.config.engine import EngineConfig
    from pdserve.engine.engine import Engine

    outs = {}
    for flag in ("1", "0"):
        config = EngineConfig(model="tiny", num_kv_blocks=64, dtype="float32", fused_ops=flag == "1")
        engine = Engine(config, loaded=tiny)
        assert engine.runner.fused_elementwise is (flag == "1")
        assert engine.runner.compiled_layers is (flag == "1")
        outs[flag] = greedy_tokens(engine, {f"r{i}": [5 + i, 60, 7, 300 + i] for i in range(3)}, 10)
    assert all(len(v) == 10 for v in outs["1"].values())
    assert outs["1"] == outs["0"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_store_kv_writes_what_the_reference_writes_from_strided_views(backend, dtype):
    torch.manual_seed(5)
    tokens, hkv, d, block_size = 9, 3, 8, 4
    qkv = torch.randn(tokens, (4 + 2) * hkv * d).to(dtype)  # k and v as views of a fused projection
    key = qkv[:, 4 * hkv * d: 5 * hkv * d].view(tokens, hkv, d)
    value = qkv[:, 5 * hkv * d:].view(tokens, hkv, d)
    slots = torch.tensor([19, 0, -1, 7, 8, 3, -1, 12, 23])
    caches = [torch.full((6, block_size, hkv, d), float("nan"), dtype=dtype) for _ in range(4)]
    backend.store_kv(key, value, caches[0], caches[1], slots)
    ReferenceBackend().store_kv(key, value, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(caches[1], caches[3], equal_nan=True, atol=0, rtol=0)
    assert int(torch.isfinite(caches[0]).all(dim=(2, 3)).sum()) == 7


def test_compiled_store_kv_refuses_a_slot_outside_the_cache_and_writes_nothing(backend):
    key, value = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        backend.store_kv(key, value, k_cache, v_cache, torch.tensor([1, 8, 2]))
    assert not k_cache.any() and not v_cache.any()


def lockstep_compiled_and_pytorch_layers(tiny, dtype: str, max_tokens: int, cpu_linear: str = "auto"):
    """Two engines fed the same three prompts (different lengths: the decode batch reads different
    block counts), one running decode steps through decoder_layer_, one through the PyTorch
    layers. Returns the engines and each one's greedy tokens per request."""
    from pdserve.config.engine import EngineConfig
    from pdserve.engine.engine import Engine

    config = EngineConfig(model="tiny", num_kv_blocks=64, dtype=dtype, cpu_linear=cpu_linear)
    engines = [Engine(config, loaded=tiny) for _ in range(2)]
    assert all(e.runner.compiled_layers for e in engines)
    engines[1].runner.model.use_compiled_layers(None)
    prompts = {f"r{i}": list(range(5 + i, 5 + 9 * (i + 1))) for i in range(3)}
    outs = [greedy_tokens(engine, prompts, max_tokens) for engine in engines]
    assert all(len(v) == max_tokens for v in outs[0].values())
    return engines, outs


@pytest.mark.parametrize("linear", ["pdserve", "onednn"])
def test_a_compiled_decoder_layer_step_writes_the_cache_and_tokens_the_pytorch_layers_do(tiny, monkeypatch, linear):
    """Same greedy tokens, and the KV caches agree to float32 rounding. The layer takes the
    projections packed either way: our panels or oneDNN's layout."""
    engines, outs = lockstep_compiled_and_pytorch_layers(tiny, "float32", max_tokens=9, cpu_linear=linear)
    assert all(e.runner.cpu_linear == linear for e in engines)
    assert outs[0] == outs[1]
    torch.testing.assert_close(engines[0].runner.kv_cache, engines[1].runner.kv_cache, atol=1e-4, rtol=1e-4)


def test_the_compiled_layers_refuse_prompt_metadata_that_does_not_cover_the_step(backend):
    """3 rows, 1 of them a decode: the prompts' offsets must end at the other 2."""
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="cover the 2 rows"):
        backend.ops.decoder_layers_(x, [], [], 0, torch.ones(8), torch.empty(0), torch.empty(0), torch.empty(0),
                                    torch.empty(0, 2, 1, 1, 1, 1), torch.empty(0), 1, torch.ones(1, dtype=torch.int32),
                                    torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32),
                                    torch.tensor([3], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                                    1, 1, 8, 8, 1e-5, 1.0)
    with pytest.raises(RuntimeError, match="num_decode 4 of 3"):
        backend.ops.decoder_layers_(x, [], [], 0, torch.ones(8), torch.empty(0), torch.empty(0), torch.empty(0),
                                    torch.empty(0, 2, 1, 1, 1, 1), torch.empty(0), 4, torch.ones(4, dtype=torch.int32),
                                    torch.zeros(4, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                    torch.zeros(0, dtype=torch.int32), torch.zeros(0, 1, dtype=torch.int32),
                                    1, 1, 8, 8, 1e-5, 1.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_layers_run_prompts_chunks_prefixes_and_mixed_steps_as_the_pytorch_layers_do(
        tmp_path, monkeypatch, dtype):
    """A 16-token budget chunks the prompts (later chunks attend over a cached prefix) and mixes
    decodes with prompt chunks; a second wave shares a cached prefix with the first. The engine
    whose steps all go through decoder_layers_ (where the backend's prefill is the compiled op:
    float32 always, bfloat16 on AMX with head size 32) gives the PyTorch layers' tokens and cache."""
    import dataclasses

    from pdserve.config.engine import EngineConfig
    from pdserve.engine.engine import Engine
    from pdserve.model.weights import load_model
    from tests.helpers.tiny_llama import make_tiny_llama_dir

    loaded = load_model(str(make_tiny_llama_dir(tmp_path / "tiny32", hidden_size=128)))  # head size 32
    # Not deterministic: that runs every row as a decode (tests/engine/test_deterministic.py).
    config = EngineConfig(model="tiny", num_kv_blocks=64, dtype=dtype, max_num_batched_tokens=16, deterministic=False)
    engines = [Engine(config, loaded=loaded) for _ in range(2)]
    model = engines[0].runner.model
    compiled = model.compiled_layers
    assert compiled is not None and engines[0].runner.compiled_layers
    backend = model.model.layers[0].self_attn.backend
    assert compiled.prefills == backend.compiles_prefill(getattr(torch, dtype), 32)
    assert compiled.prefills or dtype == "bfloat16", "float32 prefills are always the compiled op"
    recorder = StepRecorder(compiled.ops)
    model._compiled = dataclasses.replace(compiled, ops=recorder)
    engines[1].runner.model.use_compiled_layers(None)
    first = {f"a{i}": [7 + i] + list(range(20, 20 + 11 * i)) for i in range(3)}
    second = {f"b{i}": first["a2"][:20] + [90 + i, 3] for i in range(2)}  # a2's first block is cached
    outs = [{**greedy_tokens(e, first, 6), **greedy_tokens(e, second, 5)} for e in engines]
    assert outs[0] == outs[1] and all(len(v) in (5, 6) for v in outs[0].values())
    tol = 1e-4 if dtype == "float32" else 0
    torch.testing.assert_close(engines[0].runner.kv_cache, engines[1].runner.kv_cache, atol=tol, rtol=tol)
    if compiled.prefills:
        assert any(nd == 0 for _, nd in recorder.steps), "prompt-only steps"
        assert any(0 < nd < rows for rows, nd in recorder.steps), "steps that mix decodes and prompt chunks"
        assert engines[0].scheduler.pool.cache_hits > 0, "the second wave's prompts start from a cached prefix"
    else:
        assert all(nd == rows for rows, nd in recorder.steps), "only decode-only steps"


def test_a_bfloat16_compiled_decoder_layer_matches_the_pytorch_layers(tiny, monkeypatch):
    """bfloat16 with the linear `auto` picks on this CPU (the tiles where AMX or AVX512-BF16 runs
    them, oneDNN where oneDNN computes bfloat16, our panels elsewhere): the same tokens and KV
    cache as the PyTorch layers, op for op."""
    from pdserve.kernels.cpu_linear import tiles_run
    from pdserve.kernels.linear import onednn_linear_available

    engines, outs = lockstep_compiled_and_pytorch_layers(tiny, "bfloat16", max_tokens=6)
    if tiles_run(engines[0].runner.compiled_ops):
        picked = "tiles"
    else:
        picked = "onednn" if onednn_linear_available(torch.bfloat16) else "pdserve"
    assert all(e.runner.cpu_linear == picked for e in engines)
    assert outs[0] == outs[1]
    torch.testing.assert_close(engines[0].runner.kv_cache, engines[1].runner.kv_cache, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_batch_of_one_decodes_the_same_bits_on_two_threads_as_on_one(tiny, monkeypatch, dtype):
    """At batch 1 on two threads one sequence leaves the second thread without attention to do
    (on the 512-bit path a sequence is one item), and it prefetches the next weights meanwhile
    (decode_attention_then): the tokens and the KV cache are those of one thread, bit for bit."""
    from pdserve.config.engine import EngineConfig
    from pdserve.engine.engine import Engine

    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            engine = Engine(EngineConfig(model="tiny", num_kv_blocks=64, dtype=dtype), loaded=tiny)
            assert engine.runner.compiled_layers
            runs.append((greedy_tokens(engine, {"r": list(range(7, 40))}, 12), engine.runner.kv_cache))
    finally:
        torch.set_num_threads(threads)
    assert len(runs[0][0]["r"]) == 12 and runs[0][0] == runs[1][0]
    torch.testing.assert_close(runs[0][1], runs[1][1], atol=0, rtol=0)


def test_bfloat16_outputs_round_to_nearest_even_as_torch_does(backend):
    """The kernels round their float32 results to bfloat16 eight at a time: to nearest, ties to
    even, NaN kept, as torch's own conversion does (truncation would miss about half)."""
    torch.manual_seed(3)
    gate_up = torch.randn(64, 2 * 256) * 3
    gate_up[0, 0] = float("nan")
    gate, up = gate_up.chunk(2, dim=-1)
    got = backend.ops.silu_mul(gate_up.to(torch.bfloat16)).float()
    g, u = gate.to(torch.bfloat16).float(), up.to(torch.bfloat16).float()
    want = (torch.nn.functional.silu(g) * u).to(torch.bfloat16).float()
    assert got[0, 0].isnan()
    got[0, 0] = want[0, 0] = 0.0
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(1e-30)
    assert ((got - want).abs() <= ulp).all(), "at most one bfloat16 step from torch's rounding"
    assert (got == want).float().mean() > 0.99, "ties and near-ties aside, the very same bfloat16"
