"""Weight loading: GGUF and Hugging Face directories against transformers, and the load errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.model.gguf_loader import unpermute_rotary
from pdserve.model.weights import LoadedModel, load_model
from pdserve.text.model_files import DEFAULT_MODEL_NAME, ModelLoadError, default_gguf_path
from tests.helpers.tiny_llama import make_tiny_llama_dir

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


@pytest.fixture(scope="module")
def default_model() -> LoadedModel:
    return load_model("default")


@pytest.fixture(scope="module")
def hf_gguf_model():
    """transformers' own reading of the same GGUF file: the oracle."""
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny"))


def _copy_model_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


# ----- the default GGUF model --------------------------------------------------------------


def test_default_spec_loads_smollm2_with_its_served_name(default_model):
    assert default_model.name == DEFAULT_MODEL_NAME
    assert default_model.path == default_gguf_path()
    assert default_model.config.vocab_size == default_model.tokenizer.vocab_size == 49152


def test_none_spec_means_the_default_model():
    from pdserve.text.model_files import resolve_model

    assert resolve_model(None) == resolve_model("default")


@pytest.mark.slow
def test_gguf_tensors_equal_transformers_gguf_tensors(default_model, hf_gguf_model):
    theirs = hf_gguf_model.state_dict()
    ours = default_model.state_dict
    # Tied embeddings: transformers lists lm_head as an alias of the embedding; we do not.
    assert torch.equal(theirs["lm_head.weight"], theirs["model.embed_tokens.weight"])
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == theirs[name].shape, name
        assert (tensor - theirs[name]).abs().max().item() <= 1e-6, name


@pytest.mark.slow
def test_gguf_config_equals_transformers_gguf_config(default_model, hf_gguf_model):
    ours, theirs = default_model.config, hf_gguf_model.config
    assert ours.architecture == "llama"
    assert ours.vocab_size == theirs.vocab_size
    assert ours.hidden_size == theirs.hidden_size
    assert ours.intermediate_size == theirs.intermediate_size
    assert ours.num_layers == theirs.num_hidden_layers
    assert ours.num_heads == theirs.num_attention_heads
    assert ours.num_kv_heads == theirs.num_key_value_heads
    assert ours.head_dim == theirs.head_dim
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.tie_word_embeddings is True and theirs.tie_word_embeddings is True
    assert ours.rope_scaling is None


@pytest.mark.parametrize("num_heads", [9, 3, 1])
def test_unpermute_rotary_inverts_llama_cpp_permutation(num_heads):
    head_dim, hidden = 8, 12
    weight = torch.randn(num_heads * head_dim, hidden)
    # llama.cpp's convert_hf_to_gguf.py `permute`, written out.
    permuted = (
        weight.reshape(num_heads, 2, head_dim // 2, hidden).transpose(1, 2).reshape(weight.shape)
    )
    assert torch.equal(unpermute_rotary(permuted, num_heads), weight)


# ----- Hugging Face directories --------------------------------------------------------------


def test_hf_dir_weights_round_trip_exactly(tiny_dir):
    from transformers import LlamaForCausalLM

    theirs = LlamaForCausalLM.from_pretrained(tiny_dir).state_dict()
    loaded = load_model(str(tiny_dir))
    assert loaded.name == tiny_dir.name
    assert set(loaded.state_dict) == set(theirs)
    for name, tensor in loaded.state_dict.items():
        assert torch.equal(tensor, theirs[name]), name


def test_hf_dir_config_equals_transformers_config(tiny_dir):
    from transformers import AutoConfig

    ours, theirs = load_model(str(tiny_dir)).config, AutoConfig.from_pretrained(tiny_dir)
    assert (ours.architecture, ours.vocab_size, ours.hidden_size) == ("llama", 49152, 64)
    assert ours.intermediate_size == theirs.intermediate_size
    assert ours.num_layers == theirs.num_hidden_layers
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim) == (4, 2, theirs.head_dim)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.tie_word_embeddings is False
    assert ours.rope_scaling is None


def test_tiny_llama_dir_is_deterministic_for_a_seed(tmp_path, tiny_dir):
    again = make_tiny_llama_dir(tmp_path / "again")
    other = make_tiny_llama_dir(tmp_path / "other", seed=1)
    first = load_file(str(tiny_dir / "model.safetensors"))
    assert all(
        torch.equal(t, load_file(str(again / "model.safetensors"))[n]) for n, t in first.items()
    )
    assert not torch.equal(
        first["model.layers.0.self_attn.q_proj.weight"],
        load_file(str(other / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"],
    )


def test_tied_hf_dir_has_no_lm_head(tmp_path):
    path = make_tiny_llama_dir(tmp_path / "tied", num_layers=1, tie_word_embeddings=True)
    loaded = load_model(str(path))
    assert loaded.config.tie_word_embeddings is True
    assert "lm_head.weight" not in loaded.state_dict


def test_llama3_rope_scaling_becomes_config_items(tmp_path):
    path = make_tiny_llama_dir(tmp_path / "llama3", num_layers=1, rope_scaling=LLAMA3_ROPE)
    scaling = dict(load_model(str(path)).config.rope_scaling or ())
    assert scaling == LLAMA3_ROPE


def test_sharded_hf_dir_loads_every_shard(tmp_path, tiny_dir):
    path = _copy_model_dir(tiny_dir, tmp_path / "sharded")
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(path / file), metadata={"format": "pt"})
    weight_map = {n: file for file, part in shards.items() for n in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_model(str(path))
    assert set(loaded.state_dict) == set(tensors)
    assert all(torch.equal(loaded.state_dict[n], t) for n, t in tensors.items())


# ----- errors a user can act on ---------------------------------------------------------------


def test_missing_path_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not found.*'default'"):
        load_model(str(tmp_path / "nope.gguf"))


@pytest.mark.parametrize("keep_fraction", [0.001, 0.5])
def test_truncated_gguf_is_a_model_load_error(tmp_path, keep_fraction):
    data = default_gguf_path().read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_model(str(path))


def test_file_that_is_not_gguf_is_a_model_load_error(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(path))


def test_dir_without_config_json_is_a_model_load_error(tmp_path, tiny_dir):
    path = _copy_model_dir(tiny_dir, tmp_path / "noconfig")
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="lacks config.json"):
        load_model(str(path))


def test_dir_without_safetensors_is_a_model_load_error(tmp_path, tiny_dir):
    path = _copy_model_dir(tiny_dir, tmp_path / "noweights")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(str(path))


def test_unsupported_architecture_is_a_model_load_error(tmp_path, tiny_dir):
    path = _copy_model_dir(tiny_dir, tmp_path / "gpt2")
    _edit_config(path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(str(path))


def test_unsupported_rope_scaling_is_a_model_load_error(tmp_path, tiny_dir):
    path = _copy_model_dir(tiny_dir, tmp_path / "yarn")
    _edit_config(path, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(ModelLoadError, match="rope scaling 'yarn' is not supported"):
        load_model(str(path))


def test_weights_that_do_not_fit_the_config_name_the_missing_tensors(tmp_path, tiny_dir):
    path = _copy_model_dir(tiny_dir, tmp_path / "deeper")
    _edit_config(path, num_hidden_layers=3)
    with pytest.raises(ModelLoadError, match=r"missing model\.layers\.2\."):
        load_model(str(path))


def test_gguf_with_unsupported_architecture_is_a_model_load_error(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'falcon'"):
        load_model(str(path))
