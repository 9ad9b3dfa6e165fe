"""Fault injection for the chaos tests: Python loads this at start-up when a test puts this
folder on PYTHONPATH (nothing in pdserve itself knows of it).

PDSERVE_TEST_FAULTS="target:fault:count,...", where target is a role (prefill, decode) or a
worker id (the value after --worker-id), and the first `count` transfers of that process get:

  kv_flip        (prefill) one byte of the KV payload flipped after its checksum was taken, as
                 memory or wire corruption would: the decode worker's checksum check must catch it
  lease_expired  (decode) the transfer's lease counts as run out before its KV could be loaded
  step_delay_ms  (any) here `count` is milliseconds: each engine step that runs the model sleeps
                 that long first, so that a stream of a tiny model lasts long enough for a test to
                 act while it runs
"""

from __future__ import annotations

import os
import sys


def _faults() -> dict[str, int]:
    argv = list(getattr(sys, "orig_argv", ()))
    names = set(argv)
    if "--worker-id" in argv[:-1]:
        names.add(argv[argv.index("--worker-id") + 1])
    out: dict[str, int] = {}
    for item in filter(None, os.environ.get("PDSERVE_TEST_FAULTS", "").split(",")):
        target, fault, count = item.split(":")
        if target in names:
            out[fault] = int(count)
    return out


def _inject_kv_flip(count: int) -> None:
    import torch

    from pdserve.kvtransfer.transport import shm, tcp

    left = [count]
    real = tcp.describe

    def describe(t: torch.Tensor, *args, **kwargs):
        header = real(t, *args, **kwargs)
        if left[0] > 0 and t.numel() and kwargs.get("with_checksum", True):
            left[0] -= 1
            raw = t.view(torch.uint8).view(-1)
            raw[raw.numel() // 2] ^= 0x10
            print(f"FAULT kv_flip: flipped byte {raw.numel() // 2} of a {header.nbytes}-byte payload", flush=True)
        return header

    tcp.describe = shm.describe = describe


def _inject_lease_expired(count: int) -> None:
    from pdserve.kvtransfer.transport import base

    left, hit = [count], set()
    real = base.ReceivedKV.within_lease

    def within_lease(self, now=None):
        rid = self.meta.request_id
        if rid not in hit and left[0] > 0:
            left[0] -= 1
            hit.add(rid)
            print(f"FAULT lease_expired: request {rid}", flush=True)
        return False if rid in hit else real(self, now)

    base.ReceivedKV.within_lease = within_lease


def _inject_step_delay_ms(ms: int) -> None:
    import time

    from pdserve.engine import runner

    real = runner.ModelRunner.execute

    def execute(self, scheduled):
        if scheduled:
            time.sleep(ms / 1000)
        return real(self, scheduled)

    runner.ModelRunner.execute = execute


for _fault, _count in _faults().items():
    {"kv_flip": _inject_kv_flip, "lease_expired": _inject_lease_expired,
     "step_delay_ms": _inject_step_delay_ms}[_fault](_count)
