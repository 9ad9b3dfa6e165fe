"""What the device check carries: the wheel folder (bench/gpu_wheels.py) and the default model's
stand-in (bench/gpu_standin.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from pdserve.bench import gpu_standin, gpu_wheels
from pdserve.model.families import hf_model_config
from pdserve.model.weights import expected_shapes

# --- the wheels ------------------------------------------------------------------------------


def test_the_wheels_are_the_runtimes_less_torch_and_triton_and_what_the_tests_import():
    wanted = {gpu_wheels.requirement_name(s) for s in gpu_wheels.requirements()}
    assert not wanted & {"torch", "triton"}
    assert {"pyzmq", "msgspec", "llguidance", "pytest_xdist", "transformers", "openai"} <= wanted


def test_a_folder_is_complete_when_every_pin_has_its_wheel(tmp_path):
    (tmp_path / "requirements.in").write_text("pyzmq>=25\n")
    (tmp_path / "requirements.txt").write_text("pyzmq==27.3.0\nllguidance==1.9.1\n")
    (tmp_path / "pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl").touch()
    assert gpu_wheels.missing_wheels(tmp_path) == ["the wheel of llguidance==1.9.1"]
    (tmp_path / "llguidance-1.9.1-cp39-abi3-manylinux_2_31_x86_64.whl").touch()
    assert gpu_wheels.missing_wheels(tmp_path) == []


def test_a_folder_without_its_lists_says_how_to_make_it(tmp_path):
    assert all("make gpu-wheels" in m for m in gpu_wheels.missing_wheels(tmp_path))


def test_wheel_names_fold_as_pip_folds_them():
    assert gpu_wheels.normalized("Prometheus-Client") == "prometheus_client"
    assert gpu_wheels.requirement_name("llguidance>=1.9,<2") == "llguidance"


# --- the stand-in ----------------------------------------------------------------------------


@pytest.mark.slow
def test_the_stand_in_tokenizes_as_the_default_model(tmp_path, tok):
    gpu_standin.write(tmp_path)
    assert gpu_standin.problems(tmp_path) == []
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                    str(tmp_path / gpu_standin.WHEEL)], check=True)
    code = ("from pdserve.text.loader import load_tokenizer as t; from pdserve.text.tokenizer import Tokenizer; "
            "import sys; a = t('default'); b = Tokenizer.from_dir(sys.argv[1]); "
            "print(a.name, a.tokenizer.encode('Hello, world'), b.encode('Hello, world'))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / gpu_standin.MODEL_DIR)], check=True,
                         capture_output=True, text=True, env={"PYTHONPATH": str(site)}).stdout.split(" ", 1)
    ids = str(tok.encode("Hello, world"))
    assert out[0] == "SmolLM2-135M-Instruct" and out[1].strip() == f"{ids} {ids}"
    config = hf_model_config(json.loads((tmp_path / gpu_standin.MODEL_DIR / "config.json").read_text()))
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)


def test_the_weights_drawn_are_the_configs_in_bfloat16(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
              "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(gpu_standin.draw_weights(tmp_path)))
    shapes = expected_shapes(hf_model_config(config))
    assert {name: tuple(t.shape) for name, t in tensors.items()} == shapes
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert torch.equal(tensors["model.norm.weight"], torch.ones(32, dtype=torch.bfloat16))
    assert 0.01 < tensors["model.embed_tokens.weight"].float().std() < 0.03


def test_a_stand_in_without_its_wheel_is_incomplete(tmp_path):
    assert any(gpu_standin.WHEEL in p for p in gpu_standin.problems(tmp_path))
