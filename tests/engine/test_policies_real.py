"""Greedy tokens of the real SmolLM2 do not depend on how a request was scheduled.

Under every colocated policy a request's greedy output is the same alone or among 16 others
(some of which join while it decodes), with or without prefix-cache hits, and after being
pre-empted and recomputed; a prompt that shares a cached prefix computes only its suffix.
CPU float32; the weights are read once per session (`smollm2`); each LLM here is a fresh engine.
"""

from __future__ import annotations

import pytest

from pdserve.config.names import COLOCATED_POLICIES
from pdserve.engine.llm import LLM
from pdserve.protocol.sampling import SamplingParams
from tests.helpers.engine_runs import generate_joining

pytestmark = pytest.mark.slow

MAX_LEN = 256
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CHUNK_BUDGET = 48  # chunked policy: prompts longer than this are prefilled in pieces

TEXTS = [
    "Hi",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three prime numbers and explain why each of them is prime.",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "In 1969, the first",
    "Explain what a KV cache is, in one sentence, to a software engineer who has never trained a model.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,",
    "Once upon a time, in a land far away, there lived a dragon who loved to read books. " * 2,
    "Translate 'good morning' into Spanish.",
    "import numpy as np\nimport torch\n\nclass Model(torch.nn.Module):\n    def __init__(self):",
    "The mitochondria is",
    "Summarize the plot of Hamlet. "
    + "Be brief and precise, and mention every main character by name. " * 3,
    "Paris is the capital of",
    "A long list of fruits: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango,",
    "Q: Why is the sky blue?\nA:",
]


def _llm(smollm2, policy: str, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 160)
    kw.setdefault("dtype", "float32")
    kw.setdefault("block_size", BLOCK)
    return LLM(
        loaded=smollm2,
        policy=policy,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=CHUNK_BUDGET,
        **kw,
    )


def _mismatches(prompts, got, want) -> list[str]:
    return [
        f"prompt {i} ({len(p)} tokens): {g} != alone {w}"
        for i, (p, g, w) in enumerate(zip(prompts, got, want, strict=True))
        if g != w
    ]


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    return [smollm2.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def plain(smollm2) -> dict[str, LLM]:
    """One engine per policy without a prefix cache: every run computes every token."""
    return {p: _llm(smollm2, p, enable_prefix_caching=False) for p in COLOCATED_POLICIES}


@pytest.fixture(scope="module")
def alone(plain):
    """`alone(token_ids)`: the prompt's greedy tokens when it runs by itself (memoized)."""
    seen: dict[tuple[int, ...], list[int]] = {}

    def run(token_ids: list[int]) -> list[int]:
        key = tuple(token_ids)
        if key not in seen:
            seen[key] = plain["mixed"].generate([token_ids], GREEDY, use_tqdm=False)[0].token_ids
        return seen[key]

    return run


def _longest(prompts: list[list[int]]) -> list[int]:
    return max(prompts, key=len)


@pytest.mark.parametrize("policy", COLOCATED_POLICIES)
def test_greedy_tokens_alone_equal_tokens_among_sixteen_others(plain, prompts, alone, policy):
    llm = plain[policy]
    seen = len(llm.engine.counters.recent_steps)
    together = generate_joining(llm, prompts, GREEDY, first=9)
    steps = list(llm.engine.counters.recent_steps)[seen:]
    last_prefill = max(i for i, s in enumerate(steps) if s.num_prefill_tokens)
    assert any(s.num_decode_tokens for s in steps[:last_prefill]), (
        "no prompt came in while others decoded"
    )
    assert all(len(t) == GREEDY.max_tokens for t in together)
    solo = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]
    bad = _mismatches(prompts, together, solo)
    assert not bad, "\n".join(bad)
    assert solo[0] == alone(prompts[0]) and solo[-1] == alone(prompts[-1])  # same across policies


@pytest.mark.parametrize("policy", ["mixed", "chunked"])  # whole-prompt and chunked admission
def test_prefix_cache_hit_gives_the_same_tokens(smollm2, prompts, alone, policy):
    llm = _llm(smollm2, policy)
    prompt = _longest(prompts)  # several blocks; longer than the chunked policy's budget
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == BLOCK * ((len(prompt) - 1) // BLOCK) > 0
    assert first.token_ids == again.token_ids == alone(prompt)


def test_disabled_prefix_cache_never_hits_and_gives_the_same_tokens(plain, prompts, alone):
    llm = plain["chunked"]
    prompt = _longest(prompts)
    hits = llm.engine.pool.cache_hits
    outs = [llm.generate([prompt], GREEDY, use_tqdm=False)[0] for _ in range(2)]
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert llm.engine.pool.cache_hits == hits == 0
    assert outs[0].token_ids == outs[1].token_ids == alone(prompt)


@pytest.mark.parametrize("policy", COLOCATED_POLICIES)
def test_preempted_requests_recompute_to_the_same_tokens(smollm2, prompts, alone, policy):
    # 10 blocks of 8 slots: any one of these prompts (23..48 tokens) fits, all six together do not.
    llm = _llm(smollm2, policy, num_kv_blocks=10, block_size=8, enable_prefix_caching=False)
    picked = [p for p in prompts if 20 <= len(p) <= 50]
    assert len(picked) >= 5
    outs = llm.generate(picked, GREEDY, use_tqdm=False)
    assert llm.engine.counters.preemptions > 0
    assert llm.engine.scheduler.num_preemptions == llm.engine.counters.preemptions
    bad = _mismatches(picked, [o.token_ids for o in outs], [alone(p) for p in picked])
    assert not bad, "\n".join(bad)
    llm.engine.pool.check_integrity()
    assert llm.engine.pool.num_used == 0


def test_shared_three_block_prefix_computes_only_the_suffix(smollm2, alone):
    tok = smollm2.tokenizer
    prefix = tok.encode("You are a careful assistant. Answer every question in plain words. " * 4)[
        : 3 * BLOCK
    ]
    assert len(prefix) == 3 * BLOCK
    a = prefix + tok.encode(" Question: what is two plus two?")
    b = prefix + tok.encode(" Question: name a colour of the rainbow, please.")
    llm = _llm(smollm2, "chunked")

    llm.generate([a], GREEDY, use_tqdm=False)
    before = (llm.engine.counters.prefill_tokens, llm.engine.counters.decode_tokens)
    out = llm.generate([b], GREEDY, use_tqdm=False)[0]
    prefill = llm.engine.counters.prefill_tokens - before[0]
    decode = llm.engine.counters.decode_tokens - before[1]

    suffix = len(b) - 3 * BLOCK
    assert out.num_cached_tokens == 3 * BLOCK
    assert prefill == suffix
    assert decode == GREEDY.max_tokens - 1  # the first token comes from the prefill step
    assert out.token_ids == alone(b)
