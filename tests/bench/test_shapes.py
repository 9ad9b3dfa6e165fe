"""bench/shapes.py: a shape is its real model's architecture, written as a directory that pdserve
serves and transformers loads, with SmolLM2's tokenizer and a vocabulary no greedy step leaves."""

import json

import pytest
import torch

from pdserve.bench.shapes import SHAPE_FILE, SHAPES, main, write_shape
from pdserve.config.engine import EngineConfig
from pdserve.model.families import hf_model_config
from pdserve.model.weights import expected_shapes, load_model
from pdserve.protocol.sampling import SamplingParams

transformers = pytest.importorskip("transformers")


def test_the_real_shapes_have_their_models_published_parameter_counts():
    assert SHAPES["qwen2.5-0.5b"].num_parameters() == 494_032_768  # Qwen2.5-0.5B
    assert SHAPES["llama-3.2-1b"].num_parameters() == 1_235_814_400  # Llama-3.2-1B


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "llama-3.2-1b"])
def test_transformers_builds_the_shape_at_its_size(name, tok):
    shape = SHAPES[name]
    config = transformers.AutoConfig.for_model(shape.model_type, **shape.config_kwargs(tok))
    with torch.device("meta"):  # the sizes without the memory
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == shape.architecture
    assert sum(p.numel() for p in model.parameters()) == shape.num_parameters()


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "llama-3.2-1b"])
def test_pdserve_reads_the_shapes_config_as_the_real_models(name, tok):
    shape = SHAPES[name]
    config = transformers.AutoConfig.for_model(shape.model_type, **shape.config_kwargs(tok))
    mc = hf_model_config(config.to_dict())
    assert sum(torch.Size(s).numel() for s in expected_shapes(mc).values()) == shape.num_parameters()
    assert (mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.vocab_size) == (
        shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.vocab_size)
    assert mc.tie_word_embeddings and mc.rope_theta == shape.rope_theta and mc.rms_norm_eps == shape.rms_norm_eps
    if name == "qwen2.5-0.5b":
        assert mc.architecture == "qwen2" and mc.qkv_bias and mc.rope_scaling is None
    else:
        assert mc.architecture == "llama" and dict(mc.rope_scaling)["rope_type"] == "llama3"
        assert dict(mc.rope_scaling)["factor"] == 32.0


@pytest.fixture(scope="module")
def tiny_shape(tmp_path_factory):
    path = tmp_path_factory.mktemp("shape") / "tiny"
    assert write_shape(SHAPES["tiny"], path)
    return path


def test_a_written_shape_holds_bfloat16_weights_the_tokenizer_and_its_record(tiny_shape, tok):
    from safetensors import safe_open

    files = sorted(tiny_shape.glob("*.safetensors"))
    with safe_open(str(files[0]), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    assert embed.dtype == torch.bfloat16 and embed.shape == (51200, 128)
    assert torch.all(embed[tok.vocab_size:] == 0)  # no logit to pick beyond the tokenizer
    assert 0.015 < embed[:tok.vocab_size].float().std() < 0.025
    record = json.loads((tiny_shape / SHAPE_FILE).read_text())
    assert record["name"] == "tiny" and record["num_parameters"] == SHAPES["tiny"].num_parameters()
    config = json.loads((tiny_shape / "tokenizer_config.json").read_text())
    assert config["chat_template"] == tok.chat_template


def test_writing_the_same_shape_again_is_skipped_unless_forced(tiny_shape, capsys):
    before = (tiny_shape / "config.json").stat().st_mtime_ns
    assert not write_shape(SHAPES["tiny"], tiny_shape)
    main(["write", "tiny", str(tiny_shape)])
    assert "already holds tiny" in capsys.readouterr().err
    assert (tiny_shape / "config.json").stat().st_mtime_ns == before


def test_pdserve_serves_the_shape_and_greedy_tokens_stay_in_the_tokenizer(tiny_shape, tok):
    from pdserve.engine.engine import Engine

    loaded = load_model(str(tiny_shape))
    assert loaded.config.vocab_size == 51200
    engine = Engine(EngineConfig(model=str(tiny_shape), num_kv_blocks=16, dtype="float32"), loaded=loaded)
    engine.add_request("r", tok.encode("the water of the land is"), SamplingParams(temperature=0.0, max_tokens=16,
                                                                                   ignore_eos=True))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert len(tokens) == 16 and max(tokens) < tok.vocab_size


def test_an_unknown_shape_is_refused_with_the_known_ones(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["write", "llama-70b", str(tmp_path)])
    assert "qwen2.5-0.5b, llama-3.2-1b" in capsys.readouterr().err
