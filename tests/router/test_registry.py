"""Worker picking: least-queued prefill preferring a held prefix, most-free decode, transports."""

from __future__ import annotations

import pytest

from pdserve.protocol.block_hash import hash_blocks
from pdserve.protocol.messages import Heartbeat, Register
from pdserve.router.registry import Registry
from tests.helpers.fake_worker import FINGERPRINT

BS = FINGERPRINT.block_size


def reg(
    worker_id: str, role: str, *, host: str = "", transports=("tcp",), blocks: int = 100
) -> Register:
    return Register(
        worker_id=worker_id,
        role=role,
        kv_address=f"tcp://kv/{worker_id}",
        fingerprint=FINGERPRINT,
        num_blocks=blocks,
        max_model_len=4096,
        kv_transports=transports,
        host_id=host,
    )


def hb(worker_id: str, *, queued: int = 0, free: int = 100, draining: bool = False) -> Heartbeat:
    return Heartbeat(
        worker_id=worker_id,
        free_blocks=free,
        total_blocks=100,
        queued_prefill_tokens=queued,
        running=0,
        waiting=0,
        draining=draining,
    )


def registry(*regs: Register, policy: str = "auto", fallback: bool = True) -> Registry:
    r = Registry(hash_blocks, policy, fallback)
    for m in regs:
        assert r.register(m, 0.0) == (None, None)
    return r


PROMPT = list(range(4 * BS))


def test_prefill_with_fewest_queued_tokens_is_picked():
    r = registry(reg("p0", "prefill"), reg("p1", "prefill"), reg("d0", "decode"))
    r.heartbeat(hb("p0", queued=500), 0)
    r.heartbeat(hb("p1", queued=10), 0)
    assert r.pick("a", PROMPT, 8).first == "p1"


def test_tokens_sent_since_the_heartbeat_count_as_queued():
    r = registry(reg("p0", "prefill"), reg("p1", "prefill"), reg("d0", "decode"))
    first = r.pick("a", list(range(1000, 1000 + 10 * BS)), 8).first
    second = r.pick("b", list(range(5000, 5000 + BS)), 8).first
    assert first != second
    r.heartbeat(hb(first), 0)  # the heartbeat's numbers now include request a: estimate reset
    assert r.workers[first].pending_tokens == 0


def test_prefill_holding_the_prompt_prefix_is_preferred():
    r = registry(reg("p0", "prefill"), reg("p1", "prefill"), reg("d0", "decode"))
    r.heartbeat(hb("p1", queued=0), 0)
    r.heartbeat(hb("p0", queued=0), 0)
    holder = r.pick("a", PROMPT, 8).first
    other = "p0" if holder == "p1" else "p1"
    r.heartbeat(hb(holder, queued=2 * BS), 0)  # busier, but holds 4 of the 5 blocks
    r.heartbeat(hb(other, queued=0), 0)
    route = r.pick("b", PROMPT + list(range(900, 900 + BS)), 8)
    assert route.first == holder and route.cached_prefix_tokens == 4 * BS


def test_held_prefix_loses_when_its_worker_is_far_busier():
    r = registry(reg("p0", "prefill"), reg("p1", "prefill"), reg("d0", "decode"))
    holder = r.pick("a", PROMPT, 8).first
    other = "p0" if holder == "p1" else "p1"
    r.heartbeat(hb(holder, queued=100 * BS), 0)
    r.heartbeat(hb(other, queued=0), 0)
    assert r.pick("b", PROMPT, 8).first == other


def test_decode_with_most_free_blocks_is_picked_and_charged():
    r = registry(reg("p0", "prefill"), reg("d0", "decode"), reg("d1", "decode"))
    r.heartbeat(hb("d0", free=30), 0)
    r.heartbeat(hb("d1", free=20), 0)
    assert r.pick("a", list(range(BS)), BS).decode == "d0"  # charges 2 blocks: d0 has 28 left
    assert r.pick("b", list(range(BS)), 12 * BS).decode == "d0"  # 13 blocks: d0 has 15 left
    assert r.pick("c", list(range(BS)), BS).decode == "d1"


def test_decode_that_cannot_fit_the_request_is_skipped():
    r = registry(reg("p0", "prefill"), reg("d0", "decode"), reg("d1", "decode"))
    r.heartbeat(hb("d0", free=10), 0)
    r.heartbeat(hb("d1", free=5), 0)
    assert r.pick("a", list(range(BS)), 3 * BS).decode == "d0"  # 4 blocks: both fit, d0 has more
    r.heartbeat(hb("d0", free=3), 0)
    assert r.pick("b", list(range(BS)), 3 * BS).decode == "d1"  # only d1 fits 4


def test_draining_workers_are_not_picked():
    r = registry(reg("p0", "prefill"), reg("d0", "decode"), reg("c0", "colocated"))
    r.heartbeat(hb("d0", draining=True), 0)
    route = r.pick("a", PROMPT, 8)
    assert route.mode == "colocated" and route.first == "c0"


def test_colocated_least_loaded():
    r = registry(reg("c0", "colocated"), reg("c1", "colocated"))
    r.heartbeat(hb("c0", queued=100), 0)
    assert r.pick("a", PROMPT, 8).first == "c1"
    assert r.pick("a", PROMPT, 8).decode is None


def test_no_path_without_decode_or_colocated():
    r = registry(reg("p0", "prefill"))
    assert not r.has_path() and r.pick("a", PROMPT, 8) is None


@pytest.mark.parametrize(
    ("p_host", "d_host", "p_tr", "d_tr", "policy", "expected"),
    [
        ("h1", "h1", ("tcp", "shm"), ("tcp", "shm"), "auto", "shm"),
        ("h1", "h2", ("tcp", "shm"), ("tcp", "shm"), "auto", "tcp"),
        ("", "", ("tcp", "shm"), ("tcp", "shm"), "auto", "tcp"),
        ("h1", "h1", ("tcp", "shm"), ("tcp",), "auto", "tcp"),
        ("h1", "h1", ("tcp", "shm"), ("tcp", "shm"), "tcp", "tcp"),
        ("h1", "h1", ("tcp", "shm", "cuda_ipc"), ("tcp", "shm", "cuda_ipc"), "auto", "cuda_ipc"),
        ("h1", "h1", ("tcp", "shm", "cuda_ipc"), ("tcp", "shm", "cuda_ipc"), "shm", "shm"),
        ("h1", "h1", ("tcp", "shm"), ("tcp", "shm"), "cuda_ipc", "tcp"),
    ],
)
def test_kv_transport_choice(p_host, d_host, p_tr, d_tr, policy, expected):
    r = registry(
        reg("p0", "prefill", host=p_host, transports=p_tr),
        reg("d0", "decode", host=d_host, transports=d_tr),
        policy=policy,
    )
    assert r.pick("a", PROMPT, 8).kv_transport == expected


def test_expire_removes_silent_workers_only():
    r = registry(reg("p0", "prefill"), reg("d0", "decode"))
    r.heartbeat(hb("d0"), 5.0)
    assert [w.worker_id for w in r.expire(6.0, 3.0)] == ["p0"]
    assert list(r.workers) == ["d0"]


def test_repeated_register_keeps_state_but_a_new_incarnation_replaces_it():
    m = reg("p0", "prefill")
    r = registry(m, reg("d0", "decode"))
    r.pick("a", PROMPT, 8)
    assert r.register(m, 1.0) == (None, None)
    assert r.workers["p0"].requests == {"a"}
    reason, old = r.register(
        Register(**{**{f: getattr(m, f) for f in m.__struct_fields__}, "incarnation": "x"}), 2.0
    )
    assert reason is None and old.requests == {"a"} and r.workers["p0"].requests == set()


def test_bad_registration_is_refused():
    r = Registry(None)
    bad = Register(
        worker_id="d0",
        role="decode",
        kv_address="",
        fingerprint=FINGERPRINT,
        num_blocks=10,
        max_model_len=100,
    )
    assert r.register(bad, 0)[0] is not None and not r.workers


def _busy(worker_id: str, *, running: int, free: int = 100) -> Heartbeat:
    return Heartbeat(worker_id=worker_id, free_blocks=free, total_blocks=100, queued_prefill_tokens=0,
                     running=running, waiting=0)


def test_prefill_tie_on_queued_tokens_goes_to_the_one_running_fewer_requests():
    # "a-busy" sorts first by id: a tie broken by id would pick it every time.
    r = registry(reg("a-busy", "prefill"), reg("z-idle", "prefill"), reg("d0", "decode"))
    r.heartbeat(_busy("a-busy", running=5), 0)
    r.heartbeat(_busy("z-idle", running=0), 0)
    assert {r.pick(f"r{i}", PROMPT, 8).first for i in range(5)} == {"z-idle"}


def test_decode_tie_on_free_blocks_goes_to_the_one_running_fewer_requests():
    r = registry(reg("p0", "prefill"), reg("d-busy", "decode"), reg("e-idle", "decode"))
    r.heartbeat(_busy("d-busy", running=7), 0)
    r.heartbeat(_busy("e-idle", running=0), 0)
    assert r.pick("a", PROMPT, 8).decode == "e-idle"


def test_colocated_tie_on_queue_goes_to_the_one_with_more_free_blocks():
    r = registry(reg("a-full", "colocated"), reg("b-empty", "colocated"))
    r.heartbeat(_busy("a-full", running=1, free=10), 0)
    r.heartbeat(_busy("b-empty", running=1, free=90), 0)
    assert r.pick("a", PROMPT, 8).first == "b-empty"


def test_perfect_ties_are_spread_not_piled_on_the_first_id():
    picks = set()
    for i in range(40):
        r = registry(reg("c0", "colocated"), reg("c1", "colocated"))
        picks.add(r.pick(f"r{i}", PROMPT, 8).first)
    assert picks == {"c0", "c1"}


def test_with_no_prefill_worker_a_decode_worker_serves_the_request_whole():
    r = registry(reg("d0", "decode"), reg("d1", "decode"))
    r.heartbeat(hb("d0", queued=100), 0)
    assert r.has_path()
    route = r.pick("a", PROMPT, 8)
    assert route.mode == "colocated" and route.first == "d1" and route.decode is None
    assert "a" in r.workers["d1"].requests


def test_without_the_fallback_decode_workers_alone_are_no_path():
    r = registry(reg("d0", "decode"), fallback=False)
    assert not r.has_path() and r.pick("a", PROMPT, 8) is None


def test_the_fallback_is_not_used_while_a_prefill_path_exists():
    r = registry(reg("p0", "prefill"), reg("d0", "decode"))
    assert r.pick("a", PROMPT, 8).mode == "disaggregated"


def test_avoided_workers_are_used_only_when_nothing_else_serves():
    r = registry(reg("p0", "prefill"), reg("d0", "decode"), reg("d1", "decode"))
    r.heartbeat(hb("d1", free=10), 0)  # d0 would win on free blocks
    assert r.pick("a", PROMPT, 8, avoid=("d0",)).decode == "d1"
    assert r.pick("b", PROMPT, 8, avoid=("d0", "d1")).decode in {"d0", "d1"}  # rather the same than none
    route = r.pick("c", PROMPT, 8, avoid=("p0",))  # no other prefill: a decode worker alone
    assert route.mode == "colocated" and route.first in {"d0", "d1"}
