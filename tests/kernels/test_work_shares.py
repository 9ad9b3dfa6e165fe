"""parallel_for_stealing (kernels/csrc/work_shares.h), the work split of the tiles and of decode
attention, through a test-only op: torch.ops.pdserve_cpu_testing.stealing_shares_trace
(tests/kernels/csrc/stealing_shares.cpp), compiled here and never shipped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

CSRC = Path(__file__).parent / "csrc"
KERNELS_CSRC = Path(__file__).resolve().parents[2] / "kernels" / "csrc"


@pytest.fixture(scope="module")
def testing_ops(tmp_path_factory):
    """torch.ops.pdserve_cpu_testing, built once per test session (about 10 s).

    It builds in this session's own folder, not torch's shared ~/.cache/torch_extensions: a run
    killed mid-build leaves torch's lock file there, and every later run waited on it forever.
    """
    from torch.utils import cpp_extension

    cpp_extension.load(
        name="pdserve_cpu_testing",
        build_directory=str(tmp_path_factory.mktemp("torch_extension")),
        sources=[str(CSRC / "stealing_shares.cpp")],
        extra_include_paths=[str(KERNELS_CSRC)],
        extra_cflags=["-O2", "-fopenmp"],  # at::parallel_for is inline OpenMP code
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
    )
    return torch.ops.pdserve_cpu_testing


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_thread_done_with_its_share_takes_units_from_the_far_end_of_a_slower_threads(testing_ops, two_threads):
    """The tiles hand each thread its contiguous share of a weight's groups, and a thread with
    none left takes the other's from its far end (work_shares.h): here thread 0 sleeps after each
    unit, so thread 1 runs its own 20, then share 0's from the top down, while thread 0 goes on
    from the bottom. Every unit runs exactly once."""
    count, by = testing_ops.stealing_shares_trace(40, 5000)
    assert count.tolist() == [1] * 40
    assert by[20:].tolist() == [1] * 20
    share0 = by[:20].tolist()
    kept = share0.count(0)  # thread 0 ran a prefix of its share, thread 1 the rest
    assert share0 == [0] * kept + [1] * (20 - kept)
    assert kept < 20, "thread 1 took none of the sleeping thread's units"


@pytest.mark.parametrize("units", [0, 1, 3])
def test_fewer_units_than_threads_still_run_each_once(testing_ops, two_threads, units):
    count, _ = testing_ops.stealing_shares_trace(units, 0)
    assert count.tolist() == [1] * units


def test_the_production_library_holds_no_test_op(ops):
    with pytest.raises((AttributeError, RuntimeError)):
        ops.stealing_shares_trace  # noqa: B018
