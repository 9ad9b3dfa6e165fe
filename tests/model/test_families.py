"""Every supported family against transformers (the oracle), on tiny random-weight models built
from a transformers config: as a Hugging Face directory and as a GGUF file, logits and greedy
tokens in float32, through the offline engine and a prefill -> decode hand-off."""

from __future__ import annotations

import pytest
import torch

from pdserve.config.engine import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.model.families import hf_model_config
from pdserve.model.weights import load_model
from pdserve.protocol.sampling import SamplingParams
from pdserve.text.model_files import ModelLoadError
from tests.helpers.kv_pair import Pair
from tests.helpers.model_oracle import full_logits, make_runner
from tests.helpers.tiny_models import FAMILIES, hf_model, make_tiny_dir, write_gguf

# Longer than the Gemma model's window (5) and several blocks of 4, so that windows, block
# boundaries and the global layer all show.
PROMPTS = [
    "The tiny model checks every layer of ours against the reference, one position at a time.",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Paris is the capital of",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    return request.param, make_tiny_dir(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def oracle(family_dir):
    return hf_model(family_dir[1])


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def hf_greedy_uncached(hf, ids: list[int], n: int) -> list[int]:
    """Greedy tokens with every position recomputed: transformers' sliding-window cache keeps too
    little for a window of one token (its cached generate differs from its own full forward)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    return seq[len(ids):]


@pytest.mark.parametrize("block_size", [4, 16])
def test_logits_match_transformers(family_dir, oracle, block_size):
    loaded = load_model(str(family_dir[1]))
    runner = make_runner(loaded, block_size=block_size)
    ids = loaded.tokenizer.encode(PROMPTS[0])
    ours = full_logits(runner, ids)
    with torch.no_grad():
        theirs = oracle(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("attention_backend", ["reference", "cpu"])
def test_greedy_tokens_match_transformers(family_dir, oracle, attention_backend):
    """Prefill, then every decode step through the paged cache, against transformers' own cache."""
    llm = LLM(str(family_dir[1]), dtype="float32", block_size=4, attention_backend=attention_backend)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(ids, GREEDY, use_tqdm=False)
    for prompt, out in zip(ids, outs, strict=True):
        assert out.token_ids == hf_greedy(oracle, prompt, GREEDY.max_tokens)


def test_prefill_decode_handoff_matches_transformers(family_dir, oracle):
    """A prefill engine builds the KV and the first token, a decode engine goes on from the shipped
    blocks (Gemma's local layers included): the tokens are transformers'."""
    loaded = load_model(str(family_dir[1]))
    pair = Pair(loaded, EngineConfig(dtype="float32", num_kv_blocks=128, block_size=4, max_num_batched_tokens=64))
    try:
        ids = [loaded.tokenizer.encode(p) for p in PROMPTS]
        for i, prompt in enumerate(ids):
            pair.submit(f"r{i}", prompt, GREEDY)
        pair.run()
        assert pair.decode.counters.prefill_tokens == 0 and not pair.nacks
        for i, prompt in enumerate(ids):
            assert pair.tokens[f"r{i}"] == hf_greedy(oracle, prompt, GREEDY.max_tokens)
    finally:
        pair.close()


def test_gguf_matches_directory(family_dir, oracle, tmp_path):
    """The same model written as llama.cpp lays it out loads to the same weights and tokens."""
    family, path = family_dir
    gguf = write_gguf(path, tmp_path / f"{family}.gguf")
    from_gguf, from_dir = load_model(str(gguf)), load_model(str(path))
    assert from_gguf.config.architecture == from_dir.config.architecture == family
    for name, tensor in from_dir.state_dict.items():
        torch.testing.assert_close(from_gguf.state_dict[name], tensor, atol=1e-6, rtol=0, msg=name)
    llm = LLM(str(gguf), dtype="float32", block_size=4)
    ids = llm.tokenizer.encode(PROMPTS[1])
    assert llm.generate([ids], GREEDY, use_tqdm=False)[0].token_ids == hf_greedy(oracle, ids, GREEDY.max_tokens)


@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_gemma3_windows(tmp_path, window):
    """Windows smaller than a block, of a whole block, not a multiple of one, and of one token."""
    path = make_tiny_dir(tmp_path / "g", "gemma3", sliding_window=window, num_hidden_layers=3,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    hf = hf_model(path)
    llm = LLM(str(path), dtype="float32", block_size=16)
    ids = llm.tokenizer.encode(PROMPTS[0] * 3)
    assert len(ids) > 37
    assert llm.generate([ids], GREEDY, use_tqdm=False)[0].token_ids == hf_greedy_uncached(hf, ids, GREEDY.max_tokens)


def test_tied_embeddings(tmp_path):
    path = make_tiny_dir(tmp_path / "q", "qwen2", tie_word_embeddings=True)
    loaded = load_model(str(path))
    assert loaded.config.tie_word_embeddings and "lm_head.weight" not in loaded.state_dict
    runner = make_runner(loaded, block_size=4)
    ids = loaded.tokenizer.encode(PROMPTS[2])
    with torch.no_grad():
        theirs = hf_model(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(full_logits(runner, ids), theirs, atol=2e-4, rtol=1e-4)


def test_linear_rope_scaling(tmp_path):
    path = make_tiny_dir(tmp_path / "g", "gemma3", rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    loaded = load_model(str(path))
    assert dict(loaded.config.rope_scaling or ()) == {"rope_type": "linear", "factor": 8.0}
    ids = loaded.tokenizer.encode(PROMPTS[0])
    with torch.no_grad():
        theirs = hf_model(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(full_logits(make_runner(loaded, block_size=4), ids), theirs, atol=2e-4, rtol=1e-4)


def test_family_configs():
    """What each family's config.json turns into: the options that make it differ from Llama."""
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 12, "intermediate_size": 128,
            "vocab_size": 100, "max_position_embeddings": 4096}
    qwen2 = hf_model_config({**base, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False,
                             "sliding_window": 4096, "max_window_layers": 21})
    assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.layer_windows == ()
    qwen3 = hf_model_config({**base, "architectures": ["Qwen3ForCausalLM"], "head_dim": 128})
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 128
    # A Gemma 3 config.json as transformers 4.x wrote it: pattern, local base, no layer_types.
    gemma = hf_model_config({**base, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 512,
                             "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0, "rope_theta": 1e6,
                             "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh"})
    assert gemma.layer_windows == (512,) * 5 + (0,) + (512,) * 5 + (0,)
    assert (gemma.rope_theta, gemma.local_rope_theta) == (1e6, 10000.0)
    assert gemma.tie_word_embeddings and gemma.sandwich_norms and gemma.hidden_act == "gelu_tanh"
    assert gemma.softmax_scale == 256**-0.5 and gemma.embed_scale == 8.0
    mistral = hf_model_config({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 1024})
    assert mistral.layer_windows == (1024,) * 12


@pytest.mark.parametrize("arch", ["Phi3ForCausalLM", "Gemma2ForCausalLM"])
def test_unsupported_architecture_names_the_supported(arch):
    with pytest.raises(ModelLoadError, match="supported: .*Qwen2ForCausalLM.*Qwen3ForCausalLM.*Gemma3ForCausalLM"):
        hf_model_config({"architectures": [arch]})
