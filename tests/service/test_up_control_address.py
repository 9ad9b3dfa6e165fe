"""`pdserve up` publishes only a control address the router can bind and no other user can take:
a socket file in a directory private to this user, not a TCP port picked, closed and bound later."""

from __future__ import annotations

import argparse
import os
import socket
import stat
from pathlib import Path

import httpx
import pytest

from pdserve import up
from pdserve.protocol.auth import FrameAuth
from tests.helpers.fake_worker import FakeWorker, RouterHarness, toks

pytestmark = pytest.mark.timeout(60)

SECRET = b"s3cret-of-this-deployment-0123456789"


def planned(argv: list[str]) -> dict[str, list[str]]:
    parser = argparse.ArgumentParser()
    up.register(parser.add_subparsers())
    return {name: cmd for name, cmd, _ in up.plan(parser.parse_args(["up", *argv]))}


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_every_child_gets_one_control_address_in_a_directory_only_this_user_can_write():
    # No TCP port is picked, closed and published (another user could bind it before the router).
    children = planned(["--num-prefill", "1", "--num-decode", "2"])
    control = flag(children["router"], "--control-address")
    assert control.startswith("ipc:///")
    assert {flag(cmd, "--router-address") for name, cmd in children.items() if name != "router"} == {control}
    directory = Path(control.removeprefix("ipc://")).parent
    mode = directory.stat()
    assert mode.st_uid == os.getuid() and stat.S_IMODE(mode.st_mode) == 0o700


def test_the_router_binds_the_published_address_over_a_stale_socket_file_and_serves():
    control = up.private_control_address()
    path = control.removeprefix("ipc://")
    stale = socket.socket(socket.AF_UNIX)  # what a crashed router leaves behind
    stale.bind(path)
    stale.close()
    auth = FrameAuth.from_secret(SECRET)
    with RouterHarness(control_address=control, auth=auth) as h:
        assert h.control_address == control
        w = h.worker("colo-0", script=toks("Hello"))
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        r = httpx.post(h.base_url + "/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello"
        assert len(w.requests()) == 1
    # A worker of the deployment pointed at a squatter's router (another secret) never registers.
    with RouterHarness(control_address=control, auth=FrameAuth.from_secret(b"x" * 32)) as squatter:
        rogue_target = FakeWorker(control, "colo-1", auth=auth)
        rogue_target.link.start()
        assert not rogue_target.link.wait_registered(1.0)
        assert "colo-1" not in squatter.service.registry.workers
        rogue_target.link.close()
