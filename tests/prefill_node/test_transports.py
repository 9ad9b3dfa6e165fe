"""What a prefill worker offers of the KV transports it was asked for: those this machine runs,
with only the ones it cannot named, and a warning only where the operator named them."""

from __future__ import annotations

import logging

import pytest

from pdserve.config.names import KV_TRANSPORTS
from pdserve.prefill_node.worker import offered_transports

CPU_ONLY = ("tcp", "shm")  # kvtransfer.transport.available_kinds() without a CUDA GPU


def test_pdserve_ups_offer_of_every_transport_keeps_this_machines_without_a_warning(caplog):
    with caplog.at_level(logging.INFO, logger="pdserve.prefill_node.worker"):
        assert offered_transports(KV_TRANSPORTS, CPU_ONLY) == ("tcp", "shm")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    (info,) = caplog.records
    assert info.getMessage() == "KV transport cuda_ipc cannot run on this machine; offering tcp, shm"


@pytest.mark.parametrize("asked,offered", [(("cuda_ipc", "tcp"), ("tcp",)), (("cuda_ipc",), ("tcp",))])
def test_a_named_transport_this_machine_cannot_run_is_warned_of_by_name_alone(caplog, asked, offered):
    with caplog.at_level(logging.INFO, logger="pdserve.prefill_node.worker"):
        assert offered_transports(asked, CPU_ONLY) == offered
    (warning,) = caplog.records
    assert warning.levelno == logging.WARNING
    assert warning.getMessage() == f"KV transport cuda_ipc cannot run on this machine; offering {', '.join(offered)}"


@pytest.mark.parametrize("asked", [("tcp",), ("shm", "tcp"), KV_TRANSPORTS])
def test_what_the_machine_runs_is_offered_as_asked_and_silently(caplog, asked):
    with caplog.at_level(logging.DEBUG, logger="pdserve.prefill_node.worker"):
        assert offered_transports(asked, KV_TRANSPORTS) == asked
    assert not caplog.records
