"""--deterministic: a token's logits do not depend on the step that computes it, in bfloat16.

Each check compares the greedy tokens *and their logprobs*, float for float: a request alone and
the same request among 16 others under every colocated policy; a prompt prefilled in chunks of 48
tokens and in one piece (past the tiles' TILE_MAX_ROWS, where the default engine switches its
projections to oneDNN); and a stream continued from its prompt plus the tokens it had made (what a
migration recomputes on another worker) against its undisturbed run. Tiny random models of three
families whose head size takes the 512-bit attention path; the tiles where this CPU runs them and
the panels (what a CPU without AVX512-BF16 runs).
"""

from __future__ import annotations

import random

import pytest

from pdserve.config.names import COLOCATED_POLICIES
from pdserve.engine.llm import LLM
from pdserve.model.weights import load_model
from pdserve.protocol.sampling import SamplingParams
from tests.helpers.engine_runs import generate_joining_logprobs
from tests.helpers.tiny_models import make_tiny_dir

MAX_LEN = 1024
LONG = 450  # a prompt of more rows than the tiles take by default (cpu_linear.TILE_MAX_ROWS, 384)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
# Head sizes 64 and 32: the decode kernel's paired bfloat16 path (attention_avx512.h); Gemma 3
# brings sliding windows (5 tokens), GELU-tanh and sandwich norms, Qwen3 q/k norms.
SHAPES = {
    # SmolLM2's layer shape: at K of 576 and 1,536 oneDNN's rows differ from the tiles' (the
    # default engine's projections above TILE_MAX_ROWS rows).
    "llama": {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536},
    "qwen3": {},
    "gemma3": {},
}


@pytest.fixture(scope="module", params=list(SHAPES))
def model(request, tmp_path_factory):
    family = request.param
    return load_model(str(make_tiny_dir(tmp_path_factory.mktemp(family), family, **SHAPES[family])))


def _llm(model, policy: str = "chunked", budget: int = 48, cpu_linear: str = "auto", **kw) -> LLM:
    kw.setdefault("enable_prefix_caching", False)
    return LLM(loaded=model, policy=policy, dtype="bfloat16", deterministic=True, cpu_linear=cpu_linear,
               require_cpu_kernels=True, max_model_len=MAX_LEN, max_num_batched_tokens=budget,
               num_kv_blocks=600, block_size=16, **kw)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n random prompts of lengths from 1 to 240 (odd ones, one token, whole blocks and not)."""
    rng = random.Random(seed)
    lengths = [1, 2, 16, 17, 31, 33, 64, 200, 240, 5, 47, 160, 9, 63, 111, 3, 70, 25][:n]
    return [[rng.randrange(1000, 40000) for _ in range(length)] for length in lengths]


def _solo(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], list[float]]:
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return out.token_ids, out.logprobs


@pytest.mark.parametrize("policy", COLOCATED_POLICIES)
def test_a_request_alone_equals_it_among_sixteen_others_bit_for_bit(model, policy):
    llm = _llm(model, policy, budget=512)  # steps past TILE_MAX_ROWS rows
    prompts = _prompts(17)
    together = generate_joining_logprobs(llm, prompts, GREEDY, first=9)
    steps = list(llm.engine.counters.recent_steps)
    assert any(s.num_decode_tokens and s.num_prefill_tokens for s in steps) or policy in ("static", "prefill-first")
    for i, prompt in enumerate(prompts):
        tokens, logprobs = together[i]
        assert len(tokens) == GREEDY.max_tokens
        assert (tokens, logprobs) == _solo(llm, prompt), f"prompt {i} ({len(prompt)} tokens) differs among others"


@pytest.mark.parametrize("cpu_linear", ["auto", "pdserve"])
def test_a_prompt_prefilled_in_chunks_equals_it_in_one_piece(model, cpu_linear):
    prompt = [random.Random(2).randrange(1000, 40000) for _ in range(LONG)]
    chunked = _solo(_llm(model, "chunked", budget=48, cpu_linear=cpu_linear), prompt)
    whole = _solo(_llm(model, "prefill-first", budget=MAX_LEN, cpu_linear=cpu_linear), prompt)
    assert chunked == whole


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_stream_continued_from_its_tokens_equals_its_undisturbed_run(model, prefix_caching):
    """What a migration does: another worker prefills the prompt and the tokens streamed so far,
    then decodes on; every later token and logprob is the undisturbed run's."""
    llm = _llm(model, "chunked", enable_prefix_caching=prefix_caching)
    n = 24
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    prompts = _prompts(6, seed=3)
    runs = llm.generate(prompts, params, use_tqdm=False)
    for k in (1, 9, 17):
        rest = SamplingParams(temperature=0.0, max_tokens=n - k, ignore_eos=True, logprobs=0)
        resumed = llm.generate([p + r.token_ids[:k] for p, r in zip(prompts, runs, strict=True)], rest,
                               use_tqdm=False)
        for i, (run, again) in enumerate(zip(runs, resumed, strict=True)):
            assert (again.token_ids, again.logprobs) == (run.token_ids[k:], run.logprobs[k:]), (
                f"prompt {i} resumed after {k} tokens")


@pytest.mark.parametrize("kw,message", [
    ({"attention_backend": "reference"}, "needs the compiled CPU kernels"),
    ({"fused_ops": False}, "runs each step's layers in the compiled CPU kernels"),
    ({"cpu_linear": "onednn"}, "not onednn"),
])
def test_deterministic_refuses_to_start_where_it_could_not_hold(tiny, kw, message):
    with pytest.raises(ValueError, match=message):
        LLM(loaded=tiny, dtype="bfloat16", deterministic=True, max_model_len=128, num_kv_blocks=16, **kw)


@pytest.mark.parametrize("kw,expected", [
    ({"dtype": "float32"}, False),  # its prompts' attention through the decode kernel costs more
    ({"dtype": "bfloat16", "deterministic": False}, False),
    ({"dtype": "bfloat16", "attention_backend": "reference"}, False),  # no compiled layers: not an error
    ({"dtype": "bfloat16", "cpu_linear": "onednn"}, False),
    ({"dtype": "float32", "deterministic": True}, True),
])
def test_unset_it_is_on_for_bfloat16_on_native_tiles_and_off_elsewhere(tiny, kw, expected):
    llm = LLM(loaded=tiny, max_model_len=128, num_kv_blocks=16, **kw)
    assert llm.engine.runner.deterministic is expected
    if expected:
        assert llm.engine.runner.cpu_linear in ("tiles", "pdserve")


def test_unset_it_is_on_for_bfloat16_exactly_where_the_tiles_run_natively(tiny):
    from pdserve.kernels.cpu_linear import tiles_run

    runner = LLM(loaded=tiny, dtype="bfloat16", max_model_len=128, num_kv_blocks=16).engine.runner
    assert runner.deterministic is tiles_run(runner.compiled_ops)
