"""The disaggregated service on a CUDA GPU: prefill and decode workers run the model on the GPU
(Triton attention, picked by device) and hand the KV cache over by CUDA IPC, and they answer what
the offline engine answers on the same GPU, in float32 and in bfloat16.

Skipped without CUDA; `pytest -m gpu` runs it where a GPU exists.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.llm import LLM
from pdserve.protocol.sampling import SamplingParams
from tests.helpers.service_harness import Cluster
from tests.service.test_e2e import (
    CHAT,
    MAX_TOKENS,
    PROMPT,
    ask_everything,
    assert_matches_oracle,
    concurrent_chats,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(300),
]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def gpu_oracle(tiny, dtype):
    """The offline engine's greedy answers on the GPU, one request at a time."""
    llm = LLM(loaded=tiny, device="cuda", dtype=dtype)
    assert llm.engine.runner.backend.name == "triton"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=tuple(tiny.tokenizer.stop_token_ids))
    chat = llm.chat(CHAT, params, use_tqdm=False)[0]
    raw = llm.generate(PROMPT, params, use_tqdm=False)[0]
    return {"chat": (chat.text, len(chat.token_ids)), "completion": (raw.text, len(raw.token_ids))}


@pytest.fixture(scope="module")
def gpu_cluster(tiny_dir, tmp_path_factory, dtype):
    cluster = Cluster(tmp_path_factory.mktemp(f"gpu-{dtype}"), str(tiny_dir), transport="cuda_ipc",
                      prefill_transports="cuda_ipc", engine_args=("--device", "cuda", "--dtype", dtype)).start()
    yield cluster
    cluster.stop()


def test_disaggregated_over_cuda_ipc_answers_equal_the_offline_engine_on_the_gpu(gpu_cluster, gpu_oracle):
    assert_matches_oracle(ask_everything(gpu_cluster), gpu_oracle)
    handoffs = gpu_cluster.info("prefill-0")["handoffs"]
    assert handoffs and all(h["ok"] for h in handoffs)
    assert gpu_cluster.info("decode-0")["kv_bytes_received"] > 0


def test_concurrent_streams_on_the_gpu_all_complete(gpu_cluster, gpu_oracle, dtype):
    """16 streams share the decode batch. In float32 each gives the one-at-a-time answer; in
    bfloat16 a batch of another size may round differently, so there they only complete."""
    texts = concurrent_chats(gpu_cluster, 16)
    assert len(texts) == 16 and all(texts)
    if dtype == "float32":
        assert texts == [gpu_oracle["chat"][0]] * 16
    infos = gpu_cluster.wait_idle(timeout=10)
    assert all(i["used_blocks"] == 0 for i in infos.values())  # every finished request freed its blocks
