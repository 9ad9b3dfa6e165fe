"""The whole model run through the Triton attention backend gives the reference backend's greedy
tokens (and log-probs to 1e-4), on the tiny random Llama: a mixed batch whose long prompts are
chunked, a repeated prompt served from the prefix cache, and a chunked prefill over a cached prefix.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
first imported: here and in conftest.py), so the model is tiny and outputs are short.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from pdserve.engine.llm import LLM  # noqa: E402
from pdserve.protocol.sampling import SamplingParams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 4
BUDGET = 8  # tokens per step: every prompt longer than this is prefilled in chunks
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
TEXTS = [
    "Hi",
    "The quick brown fox",
    "def fibonacci(n): return n if n < 2 else",
    "Once upon a time, in a land far away, there lived a dragon who loved to read old books"
    " late at night, by the light of its own fire.",
]


@pytest.fixture(scope="module")
def engines(tiny) -> dict[str, LLM]:
    return {
        name: LLM(
            loaded=tiny,
            device=DEVICE,
            dtype="float32",  # an oracle comparison: `auto` would be bfloat16 on AMX/AVX512-BF16 CPUs
            attention_backend=name,
            policy="chunked",
            block_size=BLOCK,
            num_kv_blocks=64,
            max_num_batched_tokens=BUDGET,
            max_model_len=128,
        )
        for name in ("reference", "triton")
    }


@pytest.fixture(scope="module")
def prompts(tiny) -> list[list[int]]:
    out = [tiny.tokenizer.encode(t) for t in TEXTS]
    assert len(out[0]) <= 2 and len(out[-1]) > 3 * BUDGET  # one tiny prompt, one chunked thrice
    return out


def run_both(engines: dict[str, LLM], prompts: list[list[int]]):
    return {name: llm.generate(prompts, PARAMS, use_tqdm=False) for name, llm in engines.items()}


def assert_same(outs) -> None:
    for ref, tri in zip(outs["reference"], outs["triton"], strict=True):
        assert tri.token_ids == ref.token_ids, f"prompt of {len(ref.prompt_token_ids)} tokens"
        assert tri.num_cached_tokens == ref.num_cached_tokens
        torch.testing.assert_close(
            torch.tensor(tri.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0
        )


def test_engine_really_runs_the_triton_kernels(engines):
    assert engines["triton"].engine.runner.backend.name == "triton"
    assert engines["reference"].engine.runner.backend.name == "reference"


def test_mixed_batch_with_chunked_prompts_matches_reference(engines, prompts):
    outs = run_both(engines, prompts)
    assert_same(outs)
    assert all(len(o.token_ids) == PARAMS.max_tokens for o in outs["triton"])


def test_repeated_prompt_from_prefix_cache_matches_reference(engines, prompts):
    long = prompts[-1]
    run_both(engines, [long])  # make sure it is cached even if run alone
    outs = run_both(engines, [long])
    assert outs["triton"][0].num_cached_tokens == BLOCK * ((len(long) - 1) // BLOCK)
    assert_same(outs)


def test_chunked_prefill_over_cached_prefix_matches_reference(engines, prompts, tiny):
    long = prompts[-1]
    cached = BLOCK * (len(long) // BLOCK - 1)
    extended = long[:cached] + tiny.tokenizer.encode(
        " The dragon's favourite book, read a hundred times over, was about the stars above the"
        " mountains and the sea."
    )
    assert len(extended) - cached > 2 * BUDGET  # the suffix needs several chunks
    run_both(engines, [long])
    outs = run_both(engines, [extended])
    assert outs["triton"][0].num_cached_tokens == cached
    assert_same(outs)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3"])
def test_other_families_through_triton_match_reference(family, tmp_path):
    """Qwen2's biases, Qwen3's q/k norms and Gemma 3's windows (5, smaller than a block of 4's
    multiples) with its local rotary base: the Triton path gives the reference path's tokens, with
    chunked prompts longer than the window."""
    from tests.helpers.tiny_models import make_tiny_dir

    path = str(make_tiny_dir(tmp_path / family, family))
    kw = dict(device=DEVICE, dtype="float32", policy="chunked", block_size=BLOCK, num_kv_blocks=64,
              max_num_batched_tokens=BUDGET, max_model_len=128)
    engines = {name: LLM(path, attention_backend=name, **kw) for name in ("reference", "triton")}
    prompts = [engines["reference"].tokenizer.encode(t) for t in TEXTS[1:]]
    assert_same(run_both(engines, prompts))
