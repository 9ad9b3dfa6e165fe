"""The end-to-end harness itself: a cluster that fails to start leaves no process behind."""

from __future__ import annotations

import pytest

from tests.helpers.service_harness import Cluster


def test_failed_start_stops_every_process(tmp_path):
    # No model at this path: the processes exit while the harness waits for them, and start()
    # raises. Those still running (the router, or workers not yet at the model) must be stopped
    # before it does, since a fixture whose setup raises never reaches its teardown.
    cluster = Cluster(tmp_path, str(tmp_path / "no-such-model"))
    with pytest.raises((RuntimeError, TimeoutError)):
        cluster.start(timeout=60)
    assert cluster.procs, "the harness started nothing"
    assert all(p.popen.poll() is not None for p in cluster.procs), [
        (p.name, p.popen.poll()) for p in cluster.procs]
