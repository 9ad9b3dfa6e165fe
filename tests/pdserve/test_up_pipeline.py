"""`pdserve up` with pipeline stages: every worker's stage count (per role where asked), and the
cores each worker is pinned to: one a stage where there are enough."""

from __future__ import annotations

import os

import pytest

from pdserve.cli import build_parser
from pdserve.up import core_set, plan


def children(monkeypatch, cores: int, *argv: str) -> dict[str, tuple[list[str], tuple[int, ...] | None]]:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    return {name: (cmd, pin) for name, cmd, pin in plan(build_parser().parse_args(["up", *argv]))}


def stages_of(cmd: list[str]) -> int:
    flags = [i for i, a in enumerate(cmd) if a == "--pipeline-parallel-size"]
    return int(cmd[flags[-1] + 1]) if flags else 1  # the last flag wins


def test_every_worker_gets_the_stages_and_a_core_each(monkeypatch):
    got = children(monkeypatch, 6, "--pipeline-parallel-size", "2")
    assert stages_of(got["prefill-0"][0]) == stages_of(got["decode-0"][0]) == 2
    assert got["decode-0"][1] == (4, 5)  # the decode worker's own cores, one a stage
    assert got["prefill-0"][1] == (0, 1)
    assert got["router"][1] == (0,)


def test_per_role_counts_override_it(monkeypatch):
    got = children(monkeypatch, 4, "--decode-pipeline-parallel-size", "2")
    assert stages_of(got["prefill-0"][0]) == 1 and stages_of(got["decode-0"][0]) == 2
    assert got["decode-0"][1] == (2, 3) and got["prefill-0"][1] == (0,)
    colocated = children(monkeypatch, 4, "--colocated", "--decode-pipeline-parallel-size", "3")
    assert stages_of(colocated["decode-0"][0]) == 3
    assert colocated["decode-0"][1] is None  # unpinned: its stages split the cores


def test_a_small_machine_shares(monkeypatch):
    got = children(monkeypatch, 2, "-pp", "2")
    assert got["decode-0"][1] == (1,)  # one core left for decode: its two stages share it


@pytest.mark.parametrize("start,count,expected", [(0, 2, (0, 1)), (1, 2, (0, 1)), (0, 3, (0, 1))])
def test_core_sets_wrap_round(start, count, expected):
    assert core_set([0, 1], start, count) == expected
