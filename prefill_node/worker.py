"""The prefill worker: prompts in, first token to the router at once, KV to the decode worker.

A request's life here:  PrefillRequest -> engine (chunked prefill, prefix cache), capped at one
output token -> first token sampled -> TokenEvent to the router -> PrefillConnector holds the
blocks and, once the event is out, saves them to the decode worker's transport -> blocks held
until that worker's KVAck (or the transport's lease expiry, which also yields a NACK) ->
released (they stay in the prefix cache). A request that really ends at its first token (EOS,
max_tokens=1) ends here with no hand-off.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from pdserve.config.engine import EngineConfig
from pdserve.config.names import CHUNKED, KV_TRANSPORTS
from pdserve.config.worker import WorkerOptions
from pdserve.engine.engine import Engine, context_length
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.pipeline import stage_weights
from pdserve.kvtransfer.connector import HandoffTarget, PrefillConnector, first_token_only
from pdserve.kvtransfer.transport import available_kinds
from pdserve.model.weights import LoadedModel, load_model
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import ModelFingerprint, PrefillRequest, RetryCause
from pdserve.worker.loop import Worker, default_worker_id, error_event, model_fingerprint
from pdserve.worker.tracing import QUEUE

log = logging.getLogger(__name__)


def offered_transports(asked: tuple[str, ...], available: tuple[str, ...]) -> tuple[str, ...]:
    """The KV transports of `asked` this machine runs (tcp where none is), in the asked order.
    Those left out are logged by name alone: as a warning where the operator named them, at info
    where `asked` is every transport (`pdserve up`'s offer, which lets each machine keep its own)."""
    usable = tuple(k for k in asked if k in available) or ("tcp",)
    missing = [k for k in asked if k not in available]
    if missing:
        level = logging.INFO if set(asked) == set(KV_TRANSPORTS) else logging.WARNING
        log.log(level, "KV transport %s cannot run on this machine; offering %s", ", ".join(missing),
                ", ".join(usable))
    return usable


class PrefillWorker(Worker):
    role = "prefill"

    @classmethod
    def create(cls, options: WorkerOptions, config: EngineConfig, loaded: LoadedModel | None = None) -> PrefillWorker:
        """A prefill worker: chunked prefill, and a connector that ships each request's KV."""
        worker_id = options.worker_id or default_worker_id(cls.role)
        options = replace(options, kv_transports=offered_transports(options.kv_transports, available_kinds()),
                          worker_id=worker_id)
        config = replace(config, policy=CHUNKED)
        loaded = loaded or load_model(config.model, single_use=True, keep=stage_weights(config, 0))  # this process builds one engine
        fingerprint = model_fingerprint(config, loaded)
        connector = PrefillConnector(fingerprint, worker_id, context_length(config, loaded.config),
                                     lease_s=options.kv_lease, auth=FrameAuth.from_secret(options.secret),
                                     streaming=options.kv_streaming == "layer")
        engine = Engine(config, loaded, KVConnector(connector, connector))
        return cls(options, engine, fingerprint, connector)

    def __init__(self, options: WorkerOptions, engine: Engine, fingerprint: ModelFingerprint,
                 connector: PrefillConnector) -> None:
        super().__init__(options, engine, fingerprint)
        self.handoff = connector

    def kv_address(self) -> str:
        return ""

    def accept(self, work) -> None:
        if not isinstance(work, PrefillRequest):
            raise ValueError(f"a prefill worker takes prefill requests, not {type(work).__name__}")
        if work.kv_transport not in self.options.kv_transports:
            raise ValueError(f"KV transport {work.kv_transport!r} is not enabled on this worker")
        generated = list(work.output_token_ids)
        req = self.engine.add_request(work.request_id, list(work.token_ids),
                                      first_token_only(work.sampling, len(generated)), work.arrival_time or None,
                                      output_token_ids=generated)
        # The KV carries the epoch of the router this request came from: the decode worker routes
        # the rest of its tokens there, and refuses it once that router is gone.
        routes = self.links.routes
        epoch = routes.epoch_of(routes.owner(work.request_id))
        self.handoff.expect(work.request_id,
                            HandoffTarget(work.decode_kv_address, work.kv_transport, work.sampling, epoch,
                                          receiver_id=work.decode_worker_id))
        self.spans.started(work.request_id, work.trace_context, req, QUEUE)

    def start(self) -> PrefillWorker:
        self.handoff.open(self.options.kv_transports)
        super().start()
        self.handoff.trace_context = self.spans.kv_context  # each KVTransfer names its kv_send span
        return self

    def busy(self) -> bool:
        return self.engine.has_unfinished() or bool(self.handoff.in_flight)

    def held_request_ids(self) -> set[str]:
        return super().held_request_ids() | set(self.handoff.targets) | set(self.handoff.in_flight)

    def poll_io(self) -> None:
        for result in self.handoff.poll_acks():
            self.spans.kv_acked(result.request_id, result.ok, result.reason)
            if not result.ok:
                log.warning("request %s: KV hand-off failed: %s", result.request_id, result.reason)
                cause: RetryCause = "kv_lease_expired" if "lease" in result.reason else "kv_failed"
                self.emit(error_event(result.request_id, f"KV transfer failed: {result.reason}", retry=cause))

    def abort(self, request_ids) -> None:
        self.engine.abort(request_ids)
        for rid in request_ids:
            self.handoff.forget(rid)

    def kv_counters(self) -> tuple[int, int, float]:
        return self.handoff.bytes_sent, 0, self.handoff.transfer_seconds

    def info(self) -> dict:
        return super().info() | {"handoffs": list(self.handoff.handoffs), "kv_in_flight": len(self.handoff.in_flight)}

    def close_io(self) -> None:
        self.handoff.close()
