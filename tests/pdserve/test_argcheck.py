"""pdserve/argcheck.py: command lines checked against their own parsers, nothing run (what
bench/gpu_check.sh --dry-run does with every stage's command)."""

from __future__ import annotations

import pytest

from pdserve import argcheck


@pytest.mark.parametrize("command", [
    "timeout -k 10 30 python -m pdserve.bench.cuda_ipc_check --sizes-mb 16,64",
    "A=1 python -m pdserve up --device cuda --gpus 0,1 --gpu-memory-utilization 0.8",
    "pdserve bench compare --deployment 'a=pdserve up --colocated --port {port}' --num-requests 4",
])
def test_commands_that_parse_pass(command):
    argcheck.check(command)


@pytest.mark.parametrize("command, why", [
    ("python -m pdserve up --gpus-per-worker 2", "unrecognized arguments"),
    ("pdserve bench compare --deployment 'a=pdserve up --colocatd --port {port}'", "--colocatd"),
    ("python -m pdserve.bench.decode_profile --batch x", "invalid int"),
    ("python -m pytest tests/no_such_test.py", "no tests/no_such_test.py"),
    ("python -m json.tool", "not a module this check knows"),
])
def test_commands_that_do_not_parse_are_named_with_their_parsers_message(command, why):
    with pytest.raises(argcheck.CommandError, match=why):
        argcheck.check(command)
