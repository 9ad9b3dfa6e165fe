"""Shared fixtures: the compiled CPU kernels, the real SmolLM2 (loaded once per session) and a tiny
random Llama."""

from __future__ import annotations

import os

import pytest
import torch

# One thread: tests also start worker processes, and oversubscribed cores make torch's thread
# pool collapse (20x slower) on a small shared machine.
torch.set_num_threads(int(os.environ.get("PDSERVE_TEST_THREADS", "1")))
# Tests compare with the float32 oracle (transformers) and with each other: pin what the default
# `--dtype auto` would choose per CPU, for every process the tests start (the flag reads it).
os.environ.setdefault("PDSERVE_DTYPE", "float32")


@pytest.fixture(scope="session")
def ops():
    """torch.ops.pdserve_cpu: the compiled CPU kernels, the best prebuilt variant this CPU runs or
    (in a checkout without one) built for this machine or loaded from that build's cache, once."""
    from pdserve.kernels import cpu_ops

    return cpu_ops.load(require=True)


@pytest.fixture(scope="session")
def smollm2():
    from pdserve.model.weights import load_model

    return load_model("default")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from tests.helpers.tiny_llama import make_tiny_llama_dir

    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    from pdserve.model.weights import load_model

    return load_model(str(tiny_dir))

# Triton decides compiled vs interpreted when it is first imported: without CUDA, interpret.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def tok():
    """SmolLM2's tokenizer, read without the weights."""
    from tests.helpers.tiny_llama import default_tokenizer

    return default_tokenizer()


@pytest.fixture(scope="module")
def hf_tok():
    """transformers' tokenizer of the same GGUF: the oracle."""
    from transformers import AutoTokenizer

    from pdserve.text.model_files import default_gguf_path

    path = default_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)

