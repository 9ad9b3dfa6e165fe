"""The decode worker: prefilled requests in (KV over the transport), decode-only steps out.

KV arrival:  ReceivedKV -> its epoch is no router's we are registered with -> NACK
                        -> refused (bad checksum / fingerprint / shape) -> NACK + error event
                        -> aborted meanwhile -> NACK
                        -> its request queued, the KV kept by the DecodeConnector
                           -> admitted: blocks allocated, KV loaded before the step runs -> ACK
                           -> no room before the sender's lease runs out -> NACK + error event
The error events carry a retry cause (kv_failed, kv_lease_expired): the router sends the request
to another pair, so a bad transfer costs a recompute, never the request nor an answer from bad KV.
The engine runs the decode-only policy: every step is one token per running request. A request
belongs to the router whose epoch its KV carries: its tokens go there (worker/routes.py). When no
prefill worker is left, a router sends whole requests here (GenerateRequest) and the same policy
computes their prompts in chunks, as it does a recompute.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from pdserve.config.engine import EngineConfig
from pdserve.config.names import DECODE_ONLY
from pdserve.config.worker import WorkerOptions
from pdserve.decode_node.tombstones import Tombstones
from pdserve.engine.engine import Engine, RequestRejected
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.pipeline import stage_weights
from pdserve.kvtransfer.connector import DecodeConnector
from pdserve.kvtransfer.transport import KVReceiver, ReceivedKV, make_receiver
from pdserve.model.weights import LoadedModel, load_model
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import GenerateRequest, ModelFingerprint
from pdserve.worker.loop import Worker, error_event, model_fingerprint
from pdserve.worker.tracing import KV_ADMIT

log = logging.getLogger(__name__)


class DecodeWorker(Worker):
    role = "decode"

    @classmethod
    def create(cls, options: WorkerOptions, config: EngineConfig, loaded: LoadedModel | None = None) -> DecodeWorker:
        """A decode worker: decode-only steps, and a connector that loads arriving KV."""
        config = replace(config, policy=DECODE_ONLY)
        loaded = loaded or load_model(config.model, single_use=True, keep=stage_weights(config, 0))  # this process builds one engine
        connector = DecodeConnector()
        engine = Engine(config, loaded, KVConnector(connector, connector))
        connector.early_load = engine.pipeline is None  # stages own their layers' blocks
        return cls(options, engine, model_fingerprint(config, loaded), connector)

    def __init__(self, options: WorkerOptions, engine: Engine, fingerprint: ModelFingerprint,
                 connector: DecodeConnector) -> None:
        # The receiver serves its own kind and inline tcp (the fallback from another host).
        options = replace(options, kv_transports=tuple(dict.fromkeys((*options.kv_transports, "tcp"))))
        super().__init__(options, engine, fingerprint)
        self.kv_in = connector
        self.handoff_timings = connector.timings
        self.receiver: KVReceiver = make_receiver(
            options.kv_transports[0], f"tcp://{options.host}:{options.kv_port}", fingerprint=fingerprint,
            auth=FrameAuth.from_secret(options.secret), receiver_id=self.worker_id, on_ready=self.wake.set,
            report_parts=True,
        )
        self.aborted = Tombstones()  # aborts that may precede their KV
        self.kv_refused = 0

    def kv_address(self) -> str:
        port = self.receiver.address.rsplit(":", 1)[1]
        return f"tcp://{self.advertise_host}:{port}"

    def accept(self, work) -> None:
        """A whole request, prompt included: the router's fallback when no prefill worker is
        left. The decode-only policy computes the prompt in chunks like a recompute."""
        if not isinstance(work, GenerateRequest):
            raise ValueError(f"a decode worker takes KV transfers and generate requests, not {type(work).__name__}")
        log.info("request %s: no prefill worker; prefilling %d tokens here", work.request_id, len(work.token_ids))
        self.engine.add_request(work.request_id, list(work.token_ids), work.sampling, work.arrival_time or None,
                                output_token_ids=list(work.output_token_ids))

    def abort(self, request_ids) -> None:
        self.engine.abort(request_ids)  # the connector NACKs a transfer its request had not loaded
        for rid in request_ids:
            self.handoff_timings.pop(rid, None)
            self.kv_in.drop_set_aside(rid)
            self.receiver.drop_stream(rid)  # parts that came before the abort: nothing will end them
        self.aborted.add(request_ids)
        self._send_acks()

    def poll_io(self) -> None:
        for event in self.receiver.poll_parts():  # before the transfers that may end their streams
            if event.request_id not in self.aborted:
                self.kv_in.on_part(event, self.engine.pool, self.engine.runner)
        self.kv_in.expire_set_asides()
        for rkv in self.receiver.poll():
            try:
                self._arrived(rkv)
            except Exception as exc:  # one bad transfer costs its own request only
                log.exception("request %s: KV arrival failed", rkv.meta.request_id)
                self.kv_in.arrived.pop(rkv.meta.request_id, None)
                self._refuse(rkv, f"internal error: {exc!r}")
        for rid in self.kv_in.expired():
            self.kv_in.give_up(rid, "lease expired: no KV space on the decode worker in time")
            self.engine.abort([rid])
            self.spans.aborted([rid], "no KV space before the transfer's lease ran out")
            self.emit(error_event(rid, "decode worker out of KV space", retry="kv_lease_expired"))
        self._send_acks()

    def held_request_ids(self) -> set[str]:
        return super().held_request_ids() | set(self.kv_in.arrived)

    def _arrived(self, rkv: ReceivedKV) -> None:
        rid = rkv.meta.request_id
        router = self.links.routes.router_for_epoch(rkv.meta.epoch)
        routed = router is not None and self.links.routes.claim(rid, router)
        if not rkv.ok and routed:
            self._refuse(rkv, rkv.reason)  # its router hears why, as the prefill worker does
        elif not rkv.ok:
            self._nack(rid, rkv.reason)
        elif router is None:  # taken under a router we do not serve (any more): fenced off
            self._nack(rid, f"router epoch {rkv.meta.epoch!r} is not one this worker is registered with")
        elif not routed:
            self._nack(rid, "request id already in use on this worker")
        elif rid in self.aborted:
            self.kv_in.drop_set_aside(rid)
            self.receiver.ack(rid, False, "aborted")
        else:
            self._queue(rkv)

    def after_step(self) -> None:
        self._send_acks()  # the prefill worker frees its blocks on the ACK: send it at once

    def _queue(self, rkv: ReceivedKV) -> None:
        """The transferred request joins the waiting queue; its KV loads when it is admitted."""
        meta = rkv.meta
        num_tokens = len(meta.prompt_token_ids) + len(meta.output_token_ids)
        if not 0 < meta.num_computed_tokens < num_tokens:
            self._refuse(rkv, f"num_computed_tokens {meta.num_computed_tokens} must be in [1, {num_tokens})")
            return
        self.kv_in.expect(rkv)
        try:
            req = self.engine.add_request(meta.request_id, list(meta.prompt_token_ids), meta.sampling,
                                          meta.arrival_time or None, output_token_ids=list(meta.output_token_ids))
        except (RequestRejected, ValueError) as exc:
            self.kv_in.arrived.pop(meta.request_id, None)
            self._refuse(rkv, str(exc))
            return
        self.spans.started(meta.request_id, meta.trace_context, req, KV_ADMIT)

    def _nack(self, rid: str, reason: str) -> None:
        """Refuse a transfer without a word to any router (it is not one of ours to tell)."""
        log.warning("request %s: KV refused: %s", rid, reason)
        self.kv_refused += 1
        self.kv_in.drop_set_aside(rid)
        self.receiver.ack(rid, False, reason)

    def _refuse(self, rkv: ReceivedKV, reason: str) -> None:
        rid = rkv.meta.request_id
        log.warning("request %s: KV refused: %s", rid, reason)
        self.kv_refused += 1
        self.kv_in.drop_set_aside(rid)
        self.receiver.ack(rid, False, reason)
        self.emit(error_event(rid, f"KV transfer refused: {reason}", retry="kv_failed"))

    def _send_acks(self) -> None:
        for result in self.kv_in.take_results():
            self.receiver.ack(result.request_id, result.ok, result.reason)

    def kv_counters(self) -> tuple[int, int, float]:
        return 0, self.kv_in.bytes_received, 0.0

    def info(self) -> dict:
        return super().info() | {"kv_refused": self.kv_refused, "kv_waiting": len(self.kv_in.arrived),
                                 "receiver": self.receiver.stats(), "kv_set_aside": len(self.kv_in.set_aside),
                                 "kv_early": dict(self.kv_in.early)}

    def close_io(self) -> None:
        for rid in list(self.kv_in.arrived):
            self.kv_in.give_up(rid, "decode worker shutting down")
        for rid in list(self.kv_in.set_aside):
            self.kv_in.drop_set_aside(rid)
        self._send_acks()
        self.receiver.close()
