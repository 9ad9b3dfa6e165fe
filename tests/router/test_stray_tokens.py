"""Tokens for a request the router did not give that worker are aborted on it, not only dropped."""

from __future__ import annotations

import time

import pytest

from pdserve.protocol.messages import TokenEvent, TokenEvents
from tests.helpers.fake_worker import RouterHarness

pytestmark = pytest.mark.timeout(60)


def test_tokens_for_a_request_the_router_does_not_know_are_aborted_on_their_worker():
    with RouterHarness() as h:
        w = h.worker("decode-0", role="decode")
        w.link.send_events(TokenEvents(worker_id="decode-0", events=(
            TokenEvent(request_id="never-given", token_ids=(5,), position=1),
            TokenEvent(request_id="already-done", token_ids=(), finish_reason="stop"),
        )))
        assert h.wait_until(lambda: "never-given" in w.aborted)
        assert "already-done" not in w.aborted  # it finished there already: nothing to stop


def test_a_workers_frame_for_another_routers_epoch_is_dropped_not_obeyed():
    from pdserve.protocol.auth import CONTROL_TO_ROUTER, FrameAuth
    from pdserve.protocol.codec import encode
    from pdserve.protocol.messages import Goodbye

    secret = b"s3cret-of-this-deployment-0123456789"
    with RouterHarness(auth=FrameAuth.from_secret(secret), heartbeat_timeout=10.0) as h:
        h.worker("colo-0").hang()  # it stays registered, and quiet: what changes is the frames below
        control, peer = h.service.control, FrameAuth.from_secret(secret)

        def arrives(msg) -> None:  # as the control socket's I/O thread hands a verified frame on
            control._receive([b"colo-0", *peer.seal(CONTROL_TO_ROUTER, [encode(msg)])], time.monotonic())

        arrives(Goodbye(worker_id="colo-0", epoch="another-router"))  # captured elsewhere, replayed here
        bad = h.service.metrics.bad_messages
        assert h.wait_until(lambda: bad._value.get() >= 1)
        assert "colo-0" in h.service.registry.workers
        arrives(Goodbye(worker_id="colo-0", epoch=control.epoch))
        assert h.wait_until(lambda: "colo-0" not in h.service.registry.workers)


def test_the_router_stamps_its_epoch_on_aborts_and_a_worker_drops_another_routers():
    with RouterHarness() as h:
        w = h.worker("colo-0")
        h.service.control.abort(["colo-0"], ["r-1"])
        assert h.wait_until(lambda: "r-1" in w.aborted)
        bad_before = w.link.bad_messages
        h.service.control._out.put_nowait((b"colo-0", encode_abort("r-2", epoch="another-router")))
        h.service.control._wake()
        assert h.wait_until(lambda: w.link.bad_messages > bad_before)
        assert "r-2" not in w.aborted


def encode_abort(request_id: str, epoch: str) -> bytes:
    from pdserve.protocol.codec import encode
    from pdserve.protocol.messages import Abort

    return encode(Abort(request_ids=(request_id,), epoch=epoch))
