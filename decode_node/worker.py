"""The decode worker: prefilled requests in (KV over the transport), decode-only steps out.

KV arrival:  ReceivedKV -> refused (bad checksum / fingerprint / shape) -> NACK + error event
                        -> aborted meanwhile -> NACK
                        -> no room yet -> wait (until the sender's lease runs out)
                        -> copy into our blocks, lease still valid -> ACK; the request joins the
                           next decode step
Colocated mode (`ColocatedWorker`) takes raw prompts and prefills them itself under a policy.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from engine.engine import Engine
from engine.worker import Worker, WorkerOptions, error_event
from kvtransfer.protocol import GenerateRequest
from kvtransfer.transport import KVReceiver, ReceivedKV, make_receiver

log = logging.getLogger(__name__)

TOMBSTONE_SECONDS = 120.0


class DecodeWorker(Worker):
    role = "decode"

    def __init__(self, options: WorkerOptions, engine: Engine) -> None:
        # The receiver serves its own kind and inline tcp (the fallback from another host).
        options = replace(options, kv_transports=tuple(dict.fromkeys((*options.kv_transports, "tcp"))))
        super().__init__(options, engine)
        kind = options.kv_transports[0]
        self.receiver: KVReceiver = make_receiver(
            kind, f"tcp://{options.host}:{options.kv_port}", fingerprint=self.fingerprint
        )
        self.waiting_kv: list[ReceivedKV] = []
        self.aborted: dict[str, float] = {}  # aborts that may precede their KV
        self.kv_refused = 0

    def kv_address(self) -> str:
        port = self.receiver.address.rsplit(":", 1)[1]
        return f"tcp://{self.advertise_host}:{port}"

    def accept(self, work) -> None:
        raise ValueError(f"a disaggregated decode worker takes KV transfers, not {type(work).__name__}")

    def busy(self) -> bool:
        return self.engine.has_unfinished() or bool(self.waiting_kv)

    def abort(self, request_ids) -> None:
        self.engine.abort(request_ids)
        now = time.monotonic()
        for rid in request_ids:
            self.aborted[rid] = now
        for rkv in [r for r in self.waiting_kv if r.meta.request_id in request_ids]:
            self.waiting_kv.remove(rkv)
            self.receiver.ack(rkv.meta.request_id, False, "aborted")
        if len(self.aborted) > 10_000:
            self.aborted = {r: t for r, t in self.aborted.items() if now - t < TOMBSTONE_SECONDS}

    def poll_io(self) -> None:
        for rkv in self.receiver.poll():
            rid = rkv.meta.request_id
            if not rkv.ok:
                log.warning("request %s: KV refused: %s", rid, rkv.reason)
                self.kv_refused += 1
                self.receiver.ack(rid, False, rkv.reason)
                self.emit(error_event(rid, f"KV transfer refused: {rkv.reason}"))
            elif rid in self.aborted:
                self.receiver.ack(rid, False, "aborted")
            else:
                self.waiting_kv.append(rkv)
        for rkv in list(self.waiting_kv):
            self._admit(rkv)

    def _admit(self, rkv: ReceivedKV) -> None:
        meta = rkv.meta
        rid = meta.request_id
        try:
            admitted = self.engine.add_prefilled(
                rid, list(meta.prompt_token_ids), list(meta.output_token_ids), meta.sampling,
                rkv.payload, meta.arrival_time or None,
            )
        except ValueError as exc:
            self.waiting_kv.remove(rkv)
            self.receiver.ack(rid, False, str(exc))
            self.emit(error_event(rid, f"KV transfer refused: {exc}"))
            return
        if not admitted:
            if not rkv.within_lease():
                self.waiting_kv.remove(rkv)
                self.receiver.ack(rid, False, "no KV space on the decode worker")
                self.emit(error_event(rid, "decode worker out of KV space"))
            return
        self.waiting_kv.remove(rkv)
        if not rkv.within_lease():  # the sender may have reused the region while we copied
            self.engine.abort([rid])
            self.receiver.ack(rid, False, "lease expired")
            self.emit(error_event(rid, "KV transfer lease expired"))
            return
        self.kv_bytes_received += meta.tensor.nbytes
        self.receiver.ack(rid, True)

    def info(self) -> dict:
        return super().info() | {"kv_refused": self.kv_refused, "kv_waiting": len(self.waiting_kv),
                                 "receiver": self.receiver.stats()}

    def close_io(self) -> None:
        for rkv in self.waiting_kv:
            self.receiver.ack(rkv.meta.request_id, False, "decode worker shutting down")
        self.receiver.close()


class ColocatedWorker(Worker):
    """Prefill and decode in one engine, under a batching policy: the baseline and the fallback."""

    role = "colocated"

    def kv_address(self) -> str:
        return ""

    def accept(self, work) -> None:
        if not isinstance(work, GenerateRequest):
            raise ValueError(f"a colocated worker takes generate requests, not {type(work).__name__}")
        self.engine.add_request(work.request_id, list(work.token_ids), work.sampling, work.arrival_time or None)


__all__ = ["ColocatedWorker", "DecodeWorker", "WorkerOptions"]
