"""Shared fixtures: the real SmolLM2 (loaded once per session) and a tiny random Llama."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def smollm2():
    from engine.weights import load_model

    return load_model("default")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from tests.helpers.tiny_llama import make_tiny_llama_dir

    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    from engine.weights import load_model

    return load_model(str(tiny_dir))

# Triton decides compiled vs interpreted when it is first imported: without CUDA, interpret.
if not torch.cuda.is_available():
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
