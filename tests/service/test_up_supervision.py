"""`pdserve up` supervises: a worker killed with -9 is started again, and the rest keep serving."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import httpx
import pytest

from pdserve.supervisor import Supervisor
from tests.helpers.up_harness import Up

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def up(tiny_dir, tmp_path_factory):
    u = Up(str(tiny_dir), tmp_path_factory.mktemp("supervision") / "up.log").start()
    yield u
    u.stop()


def complete(u: Up) -> int:
    return httpx.post(f"{u.base_url}/v1/completions", timeout=30,
                      json={"model": u.model(), "prompt": "hello", "max_tokens": 4, "temperature": 0}).status_code


@pytest.mark.parametrize("victim", ["decode-0", "prefill-1", "prefill-0", "decode-1"])  # any one, in turn
def test_a_killed_worker_is_restarted_and_the_deployment_keeps_serving(up, victim):
    assert complete(up) == 200
    old = up.signal(victim, signal.SIGKILL)
    deadline, served = time.monotonic() + 15, 0
    while time.monotonic() < deadline and served < 3:  # the survivors serve meanwhile
        served += complete(up) == 200
    assert served == 3
    deadline = time.monotonic() + 90
    while not (up.pid(victim) != old and up.workers() == up.want):  # restarted, and registered
        assert up.proc.poll() is None, "pdserve up gave up: " + up.log()[-2000:]
        assert time.monotonic() < deadline, up.log()[-3000:]
        time.sleep(0.3)
    assert f"{victim} restarted" in up.log()
    assert re.search(rf"{victim} \(pid {old}\) exited with status -9; restarting", up.log())
    assert complete(up) == 200


def test_a_child_that_keeps_dying_backs_off_longer_each_time(tmp_path):
    now = [0.0]
    sup = Supervisor([("worker", [sys.executable, "-c", "raise SystemExit(3)"], None)], dict(os.environ),
                     min_backoff=1.0, max_backoff=4.0, stable_after=60.0, clock=lambda: now[0]).start()
    backoffs = []
    try:
        for _ in range(4):
            sup.children[0].popen.wait(30)
            sup.poll()  # notices the death, schedules the restart
            backoffs.append(sup.children[0].backoff)
            now[0] += backoffs[-1]
            assert [c.name for c in sup.poll()] == ["worker"]
        assert backoffs == [1.0, 2.0, 4.0, 4.0] and sup.children[0].history[:4] == [3, 3, 3, 3]
    finally:
        sup.stop(timeout=5)


@pytest.mark.parametrize("argv,expected", [(["up"], "2"), (["up", "--num-prefill", "2"], "3"), (["up", "--colocated"], "1")])
def test_up_tells_the_router_how_many_workers_to_wait_for(argv, expected):
    import argparse

    from pdserve import up as up_command

    parser = argparse.ArgumentParser()
    up_command.register(parser.add_subparsers())
    children = up_command.plan(parser.parse_args(argv))
    router = dict((name, cmd) for name, cmd, _ in children)["router"]
    assert router[router.index("--expect-workers") + 1] == expected
    assert len(children) - 1 == int(expected)
