"""A prefill engine and a decode engine in one process, joined by the KV connectors and a real
transport, driven the way the two workers' loops drive them (tests/engine/test_kv_connector.py)."""

from __future__ import annotations

import time
from dataclasses import replace

from pdserve.config.engine import EngineConfig
from pdserve.config.names import CHUNKED, DECODE_ONLY
from pdserve.engine.engine import Engine, context_length
from pdserve.engine.kv_connector import KVConnector
from pdserve.kvtransfer.connector import (
    DecodeConnector,
    HandoffTarget,
    PrefillConnector,
    first_token_only,
)
from pdserve.kvtransfer.transport import ReceivedKV, make_receiver
from pdserve.protocol.sampling import SamplingParams
from pdserve.worker.loop import model_fingerprint

WAIT = 30.0


class Pair:
    """A prefill engine and a decode engine, driven the way the two workers' loops drive them."""

    def __init__(self, loaded, cfg: EngineConfig, kind: str = "tcp", decode_blocks: int | None = None,
                 prefill_stages: int = 1, decode_stages: int = 1) -> None:
        fp = model_fingerprint(cfg, loaded)
        self.out_conn = PrefillConnector(fp, "prefill-test", context_length(cfg, loaded.config), lease_s=10.0)
        self.prefill = Engine(replace(cfg, policy=CHUNKED, pipeline_parallel_size=prefill_stages), loaded,
                              KVConnector(self.out_conn, self.out_conn))
        self.in_conn = DecodeConnector(early_load=decode_stages == 1)
        self.decode = Engine(replace(cfg, policy=DECODE_ONLY, num_kv_blocks=decode_blocks or cfg.num_kv_blocks,
                                     pipeline_parallel_size=decode_stages),
                             loaded, KVConnector(self.in_conn, self.in_conn))
        self.receiver = make_receiver(kind, "tcp://127.0.0.1:0", fingerprint=fp, report_parts=True)
        self.kind = kind
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.prefill_outputs = []
        self.decode_outputs = []
        self.nacks: list = []

    def submit(self, rid: str, prompt: list[int], sampling: SamplingParams) -> None:
        self.prefill.add_request(rid, prompt, first_token_only(sampling))
        self.out_conn.expect(rid, HandoffTarget(self.receiver.address, self.kind, sampling))
        self.tokens[rid] = []

    def turn(self, admit=None) -> None:
        self.prefill.reclaim()
        if self.prefill.has_unfinished():
            outs = self.prefill.step()
            self.prefill_outputs += outs
            self._record(outs)
            self.prefill.save_kv()
        self.nacks += [r for r in self.out_conn.poll_acks() if not r.ok]
        for event in self.receiver.poll_parts():  # as the decode worker's poll_io does
            self.in_conn.on_part(event, self.decode.pool, self.decode.runner)
        for rkv in self.receiver.poll(timeout=0.01):
            (admit or self.admit)(rkv)
        if self.decode.has_unfinished():
            outs = self.decode.step()
            self.decode_outputs += outs
            self._record(outs)
        for r in self.in_conn.take_results():
            self.receiver.ack(r.request_id, r.ok, r.reason)

    def admit(self, rkv: ReceivedKV) -> None:
        assert rkv.ok, rkv.reason
        meta = rkv.meta
        self.in_conn.expect(rkv)
        self.decode.add_request(meta.request_id, list(meta.prompt_token_ids), meta.sampling,
                                output_token_ids=list(meta.output_token_ids))

    def run(self, admit=None) -> None:
        deadline = time.monotonic() + WAIT
        while len(self.finish) < len(self.tokens) or self.out_conn.in_flight:
            assert time.monotonic() < deadline, f"stuck: finished {sorted(self.finish)}"
            self.turn(admit)
        self.turn()  # the last acks release the prefill blocks

    def _record(self, outs) -> None:
        for o in outs:
            self.tokens[o.request_id].extend(o.new_token_ids)
            if o.finish_reason:
                self.finish[o.request_id] = o.finish_reason

    def close(self) -> None:
        self.out_conn.close()
        self.receiver.close()
        self.prefill.close()
        self.decode.close()
