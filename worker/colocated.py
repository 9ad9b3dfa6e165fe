"""The colocated worker: prompts in, every token out, prefill and decode in one engine.

It is the baseline the benchmark compares disaggregation with (under any batching policy), and
the same process a decode worker runs with `--mode colocated`. No KV enters or leaves it.
"""

from __future__ import annotations

from pdserve.config.engine import EngineConfig
from pdserve.config.worker import WorkerOptions
from pdserve.engine.engine import Engine
from pdserve.engine.pipeline import stage_weights
from pdserve.model.weights import LoadedModel, load_model
from pdserve.protocol.messages import GenerateRequest
from pdserve.worker.loop import Worker, model_fingerprint
from pdserve.worker.tracing import QUEUE


class ColocatedWorker(Worker):
    """Prefill and decode in one engine, under a batching policy: the baseline and the fallback."""

    role = "colocated"

    @classmethod
    def create(cls, options: WorkerOptions, config: EngineConfig, loaded: LoadedModel | None = None) -> ColocatedWorker:
        loaded = loaded or load_model(config.model, single_use=True, keep=stage_weights(config, 0))  # this process builds one engine
        return cls(options, Engine(config, loaded), model_fingerprint(config, loaded))

    def kv_address(self) -> str:
        return ""

    def accept(self, work) -> None:
        if not isinstance(work, GenerateRequest):
            raise ValueError(f"a colocated worker takes generate requests, not {type(work).__name__}")
        req = self.engine.add_request(work.request_id, list(work.token_ids), work.sampling, work.arrival_time or None,
                                      output_token_ids=list(work.output_token_ids))
        self.spans.started(work.request_id, work.trace_context, req, QUEUE)
