"""pdserve/gpus.py and `pdserve up --gpus`: each worker on its own GPU, in turn; workers that
share a GPU share its memory."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.config.engine import ConfigError
from pdserve.gpus import Placement, gpus_for, parse_gpus, place_workers
from pdserve.up import plan


def no_count() -> int:
    raise AssertionError("the visible GPUs are counted only without --gpus and a device index")


def test_one_worker_per_gpu_in_turn():
    assert place_workers(2, (0, 1), 0.9) == [Placement("cuda:0", 0.9), Placement("cuda:1", 0.9)]


def test_more_workers_than_gpus_start_the_list_over_and_split_the_memory():
    assert place_workers(3, (0, 1), 0.9) == [Placement("cuda:0", 0.45), Placement("cuda:1", 0.9),
                                             Placement("cuda:0", 0.45)]


def test_gpus_past_the_workers_stay_idle():
    assert [p.device for p in place_workers(2, (2, 3, 5), 0.8)] == ["cuda:2", "cuda:3"]


def test_without_gpus_every_visible_one_is_used():
    assert gpus_for("cuda", "", lambda: 4) == (0, 1, 2, 3)


def test_a_device_index_keeps_every_worker_on_that_gpu():
    assert gpus_for("cuda:3", "", no_count) == (3,)
    assert gpus_for("cuda:3", "0,1", no_count) == (0, 1)


@pytest.mark.parametrize("text", ["0,x", "1,1", "-1"])
def test_a_bad_gpu_list_is_refused(text):
    with pytest.raises(ValueError, match="--gpus"):
        parse_gpus(text)


def test_no_visible_gpu_is_an_error():
    with pytest.raises(ValueError, match="no CUDA GPU"):
        gpus_for("cuda", "", lambda: 0)


def worker_flags(argv: list[str]) -> dict[str, tuple[str, str]]:
    """name -> (--device, --gpu-memory-utilization) of each worker `pdserve up argv` starts."""
    out = {}
    for name, cmd, _ in plan(build_parser().parse_args(["up", *argv])):
        if name != "router":
            out[name] = (cmd[cmd.index("--device") + 1], cmd[cmd.index("--gpu-memory-utilization") + 1])
    return out


def test_up_spreads_its_workers_over_the_listed_gpus():
    assert worker_flags(["--device", "cuda", "--gpus", "0,1"]) == {"prefill-0": ("cuda:0", "0.9"),
                                                                   "decode-0": ("cuda:1", "0.9")}


def test_up_on_one_gpu_gives_each_worker_half_of_it():
    assert worker_flags(["--device", "cuda:0", "--num-decode", "1"]) == {"prefill-0": ("cuda:0", "0.45"),
                                                                         "decode-0": ("cuda:0", "0.45")}


def test_up_on_the_cpu_leaves_the_device_alone():
    assert {d for d, _ in worker_flags([]).values()} == {"cpu"}


def test_gpus_without_cuda_is_refused():
    with pytest.raises(ConfigError, match="--gpus .* --device cuda"):
        worker_flags(["--gpus", "0,1"])
