"""The prefill worker: prompts in, first token to the router at once, KV to the decode worker.

A request's life here:  PrefillRequest -> engine (chunked prefill, prefix cache) -> first token
sampled -> TokenEvent to the router -> KV blocks gathered and handed to the transport -> blocks
held until the decode worker's KVAck (or the transport's lease expiry, which also yields a NACK)
-> released (they stay in the prefix cache).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace

from engine.engine import Engine
from engine.worker import Worker, WorkerOptions, error_event
from kvtransfer.protocol import KVTransfer, PrefillRequest
from kvtransfer.tensors import describe
from kvtransfer.transport import KVSender, available_kinds, make_sender

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Target:
    address: str
    transport: str
    first_token_at: float = 0.0  # first token handed to the router link
    sent_at: float = 0.0  # KV handed to the transport
    nbytes: int = 0


class PrefillWorker(Worker):
    role = "prefill"

    def __init__(self, options: WorkerOptions, engine: Engine) -> None:
        usable = tuple(k for k in options.kv_transports if k in available_kinds())
        if usable != options.kv_transports:
            log.warning("KV transports %s are unavailable here; offering %s", options.kv_transports, usable)
        super().__init__(replace(options, kv_transports=usable or ("tcp",)), engine)
        self.senders: dict[str, KVSender] = {}
        self.targets: dict[str, Target] = {}  # request id -> where its KV goes
        self.in_flight: dict[str, Target] = {}  # handed to the transport, waiting for the ack
        self.handoffs: deque[dict] = deque(maxlen=64)  # recent hand-off timelines, for /info

    def kv_address(self) -> str:
        return ""

    def accept(self, work) -> None:
        if not isinstance(work, PrefillRequest):
            raise ValueError(f"a prefill worker takes prefill requests, not {type(work).__name__}")
        if work.kv_transport not in self.options.kv_transports:
            raise ValueError(f"KV transport {work.kv_transport!r} is not enabled on this worker")
        self.engine.add_request(work.request_id, list(work.token_ids), work.sampling, work.arrival_time or None)
        self.targets[work.request_id] = Target(work.decode_kv_address, work.kv_transport)

    def busy(self) -> bool:
        return self.engine.has_unfinished() or bool(self.in_flight)

    def after_step(self) -> None:
        # The first tokens of this step are already queued for the router; flush them before the
        # (slower) KV hand-off so TTFT never waits on the transfer.
        self._flush()
        flushed = time.time()
        for req in self.engine.take_prefilled():
            target = self.targets.pop(req.request_id, None)
            if target is None:
                self.engine.release(req.request_id)
                continue
            payload = self.engine.export_kv(req)
            meta = KVTransfer(
                request_id=req.request_id, prefill_worker_id=self.worker_id,
                prompt_token_ids=tuple(req.prompt_token_ids), output_token_ids=tuple(req.output_token_ids),
                sampling=req.sampling, num_computed_tokens=req.num_computed_tokens,
                fingerprint=self.fingerprint, tensor=describe(payload, with_checksum=False),
                transport=target.transport, arrival_time=req.arrival_time,
            )
            target.first_token_at = flushed
            target.sent_at, target.nbytes = time.time(), payload.numel() * payload.element_size()
            self._sender(target.transport).send(target.address, meta, payload)
            self.in_flight[req.request_id] = target
        # Requests that finished here (EOS, max_tokens=1, aborted) need no hand-off.
        for rid in [r for r in self.targets if r not in self.engine.scheduler.requests]:
            del self.targets[rid]

    def poll_io(self) -> None:
        for sender in self.senders.values():
            for ack in sender.poll_acks():
                target = self.in_flight.pop(ack.request_id, None)
                self.engine.release(ack.request_id)
                if target is None:
                    continue
                self.handoffs.append({"request_id": ack.request_id, "ok": ack.ok, "bytes": target.nbytes,
                                      "first_token_at": target.first_token_at, "kv_sent_at": target.sent_at,
                                      "kv_acked_at": time.time()})
                if ack.ok:
                    self.kv_bytes_sent += target.nbytes
                    self.kv_transfer_seconds += time.time() - target.sent_at
                else:
                    log.warning("request %s: KV hand-off failed: %s", ack.request_id, ack.reason)
                    self.emit(error_event(ack.request_id, f"KV transfer failed: {ack.reason}"))

    def abort(self, request_ids) -> None:
        self.engine.abort(request_ids)
        for rid in request_ids:
            self.targets.pop(rid, None)  # an in-flight transfer still ends in an ack or lease expiry

    def info(self) -> dict:
        return super().info() | {"handoffs": list(self.handoffs), "kv_in_flight": len(self.in_flight)}

    def _sender(self, kind: str) -> KVSender:
        if kind not in self.senders:
            self.senders[kind] = make_sender(kind, lease_s=self.options.kv_lease)
        return self.senders[kind]

    def close_io(self) -> None:
        for sender in self.senders.values():
            sender.close()
