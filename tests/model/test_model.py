"""Our Llama against transformers (the oracle), on the tiny random model and on SmolLM2."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.llm import LLM
from pdserve.protocol.sampling import SamplingParams
from tests.helpers.model_oracle import full_logits, make_runner

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=False)

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a KV cache is in one sentence.",
    "Translate 'good morning' into Spanish.",
]
RAW = [
    "The quick brown fox",
    "def fibonacci(n):",
    "In 1969, the first",
    "Paris is the capital of",
    "1, 2, 3, 4,",
]


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_smollm2(smollm2):
    from transformers import AutoModelForCausalLM

    path = smollm2.path
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32).eval()


def hf_greedy(hf, prompt_ids: list[int], n: int, eos: int | None) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                          pad_token_id=eos if eos is not None else 0)
    return out[0, len(prompt_ids):].tolist()


def test_tiny_logits_match_transformers(tiny, hf_tiny):
    runner = make_runner(tiny, block_size=4)
    ids = tiny.tokenizer.encode("The tiny model checks every layer of ours against the reference.")
    ours = full_logits(runner, ids)
    with torch.no_grad():
        theirs = hf_tiny(torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4


def test_tiny_greedy_matches_transformers(tiny, hf_tiny):
    llm = LLM(dtype="float32", loaded=tiny, block_size=4, max_model_len=256)
    prompts = [tiny.tokenizer.encode(p) for p in RAW]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf_tiny, ids, 24, None)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2, hf_smollm2):
    runner = make_runner(smollm2)
    for text in RAW:
        ids = smollm2.tokenizer.encode(text)
        ours = full_logits(runner, ids)
        with torch.no_grad():
            theirs = hf_smollm2(torch.tensor([ids])).logits[0]
        assert (ours - theirs).abs().max().item() < 1e-3, text


@pytest.mark.slow
def test_smollm2_greedy_chat_matches_transformers(smollm2, hf_smollm2):
    llm = LLM(dtype="float32", loaded=smollm2, max_model_len=1024)
    convs = [[{"role": "user", "content": c}] for c in CHATS]
    outs = llm.chat(convs, GREEDY, use_tqdm=False)
    eos = smollm2.tokenizer.eos_token_id
    for out in outs:
        assert out.token_ids == hf_greedy(hf_smollm2, out.prompt_token_ids, 32, eos)


@pytest.mark.slow
def test_smollm2_answers_paris(smollm2):
    llm = LLM(dtype="float32", loaded=smollm2, max_model_len=1024)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY, use_tqdm=False)[0]
    assert "Paris" in out.text


@pytest.mark.slow
def test_smollm2_batched_equals_alone(smollm2):
    llm = LLM(dtype="float32", loaded=smollm2, max_model_len=1024)
    texts = [f"Story {i}: " + "once upon a time " * (i * 3) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    together = llm.generate(texts, params, use_tqdm=False)
    for text, out in zip(texts, together, strict=True):
        alone = llm.generate(text, params, use_tqdm=False)[0]
        assert out.token_ids == alone.token_ids
