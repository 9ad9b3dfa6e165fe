"""A KV transfer names its decode worker: one captured on its way there and replayed into another
decode worker (whose replay window never saw it) is dropped there, undecoded and unanswered."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from pdserve.kvtransfer.tensors import as_bytes, describe
from pdserve.kvtransfer.transport.handshake import secure_client
from pdserve.kvtransfer.transport.tcp import TcpKVReceiver
from pdserve.protocol.auth import KV_TO_DECODE, FrameAuth
from pdserve.protocol.codec import encode
from tests.kvtransfer.test_transports import SMALL, make_meta, make_payload

pytestmark = pytest.mark.timeout(60)

SECRET = b"s3cret-of-this-deployment-0123456789"


def test_a_kv_transfer_replayed_to_another_decode_worker_is_refused():
    auth = FrameAuth.from_secret(SECRET)
    with TcpKVReceiver("tcp://127.0.0.1:0", auth=FrameAuth.from_secret(SECRET), receiver_id="decode-a") as a, \
            TcpKVReceiver("tcp://127.0.0.1:0", auth=FrameAuth.from_secret(SECRET), receiver_id="decode-b") as b:
        payload = make_payload(SMALL, 2)
        meta = msgspec.structs.replace(make_meta(payload, SMALL, "r-1"), tensor=describe(payload), transport="tcp",
                                       receiver_id="decode-a")
        # The MAC covers the header, which carries the payload's checksum (docs/security.md).
        captured = [*auth.seal(KV_TO_DECODE, [encode(meta)]), as_bytes(payload).numpy().tobytes()]
        ctx = zmq.Context.instance()
        for receiver in (a, b):  # the original to decode-a, then its replay to decode-b
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            secure_client(sock, auth)  # the worst case: a peer that got past the handshake
            sock.connect(receiver.address)
            sock.send_multipart(captured)
            if receiver is a:
                [rkv] = a.poll(timeout=5.0)
                assert rkv.ok and rkv.meta.request_id == "r-1"
            else:
                assert b.poll(timeout=1.0) == []
                assert b.stats()["wrong_receiver"] == 1 and b.stats().get("received", 0) == 0
            sock.close()
