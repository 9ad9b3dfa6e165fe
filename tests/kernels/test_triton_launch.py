"""kernels/triton_launch.py: a Triton launch runs on the device of its tensor arguments, not on
whichever device is current (Triton launches on the current one)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from pdserve.kernels import triton_decode, triton_elementwise, triton_prefill, triton_store_kv
from pdserve.kernels.testing import make_case
from pdserve.kernels.triton_launch import OnDevice, for_device

needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs two CUDA GPUs")


class FakeKernel:
    """Records the current device at each launch."""

    def __init__(self, current: list[int]) -> None:
        self.current, self.launched_on = current, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched_on.append(self.current[0])


@pytest.fixture
def current(monkeypatch) -> list[int]:
    """torch.cuda's current device, simulated: cuda:0 to start with."""
    now = [0]

    @contextlib.contextmanager
    def device(index):
        before, now[0] = now[0], index
        try:
            yield
        finally:
            now[0] = before

    monkeypatch.setattr(torch.cuda, "current_device", lambda: now[0])
    monkeypatch.setattr(torch.cuda, "device", device)
    return now


def test_a_launch_on_another_device_runs_with_that_device_current(current):
    kernel = FakeKernel(current)
    launcher = for_device(kernel, torch.device("cuda", 1))
    assert isinstance(launcher, OnDevice)
    launcher[(1,)]()
    assert kernel.launched_on == [1] and current == [0]  # switched for the launch only


@pytest.mark.parametrize("device", [torch.device("cuda", 0), torch.device("cuda")])
def test_a_launch_on_the_current_device_is_the_kernel_itself(current, device):
    kernel = FakeKernel(current)
    assert for_device(kernel, device) is kernel


def test_every_launch_names_the_device_of_its_own_tensors(monkeypatch):
    """Each kernel module asks for_device for the device of the tensors it launches on (here
    the meta device: the launch code runs, nothing is computed)."""
    asked: list[torch.device] = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    def record(kernel, device):
        asked.append(device)
        return Recorder()

    for module in (triton_decode, triton_prefill, triton_store_kv, triton_elementwise):
        monkeypatch.setattr(module, "for_device", record)
    meta = torch.device("meta")
    case = make_case([3, 1], [5, 9], num_kv_heads=2, group=2, head_dim=32, block_size=16, dtype=torch.float32)
    c = {name: getattr(case, name).to(meta) for name in ("q", "key", "value", "k_cache", "v_cache", "slot_mapping",
                                                           "cu_seqlens_q", "seq_lens", "block_tables")}
    triton_store_kv.store_kv(c["key"], c["value"], c["k_cache"], c["v_cache"], c["slot_mapping"])
    triton_prefill.prefill_attention(c["q"], c["key"], c["value"], c["k_cache"], c["v_cache"], c["cu_seqlens_q"],
                                     c["seq_lens"], c["block_tables"], 0.1)
    triton_decode.decode_attention(c["q"][:2], c["k_cache"], c["v_cache"], c["seq_lens"], c["block_tables"], 0.1,
                                   splits=2)
    ops = triton_elementwise.TritonElementwise()
    x = torch.empty(4, 64, device=meta)
    ops.rms_norm(x, torch.empty(64, device=meta), 1e-5)
    ops.silu_mul(torch.empty(4, 128, device=meta))
    ops.rotary_(c["q"], c["key"], torch.empty(4, dtype=torch.int64, device=meta),
                torch.empty(8, 16, device=meta), torch.empty(8, 16, device=meta))
    assert len(asked) == 8 and set(asked) == {meta}


@pytest.mark.gpu
@needs_two_gpus
def test_decode_on_the_second_gpu_matches_the_reference_while_the_first_is_current():
    from pdserve.kernels.reference import ReferenceBackend
    from pdserve.kernels.triton_backend import TritonBackend

    torch.cuda.set_device(0)
    case = make_case([1, 1], [40, 7], num_kv_heads=2, group=2, head_dim=64, block_size=16, dtype=torch.bfloat16,
                     device=torch.device("cuda", 1))
    args = (case.q, case.k_cache, case.v_cache, case.seq_lens, case.block_tables, case.scale)
    got = TritonBackend().decode_attention(*args)
    want = ReferenceBackend().decode_attention(*args)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert got.device == torch.device("cuda", 1) and torch.cuda.current_device() == 0
