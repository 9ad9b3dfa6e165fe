"""engine/device.py: the device an engine runs on, a step's upload in one packed copy, the KV
stream, and the KV cache sized from the device's memory."""

from __future__ import annotations

import contextlib
from array import array
from types import SimpleNamespace

import pytest
import torch

from pdserve.config.engine import ConfigError, EngineConfig
from pdserve.engine import device as device_module
from pdserve.engine.device import (
    ALIGN,
    HostPart,
    StepUploader,
    kv_cache_blocks,
    kv_stream,
    layout,
    on_kv_stream,
    select_device,
    weights_bytes,
)
from pdserve.engine.kv_cache import kv_block_bytes
from pdserve.model.config import ModelConfig

CPU = torch.device("cpu")
GiB = 2**30
MODEL = ModelConfig("llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def step_parts() -> list[HostPart]:
    """A step as the runner packs it: three int64 token arrays, then int32 per-sequence ones,
    an odd number of int32 values right before an int64 part."""
    return [
        HostPart(array("q", [5, 6, 7]), torch.int64),                         # input_ids
        HostPart(array("q", [10, 11, 12]), torch.int64),                      # positions
        HostPart(array("i", [3, 4, 5]), torch.int32),                         # seq_lens: 12 bytes
        HostPart(array("q", [40, 41, 42]), torch.int64),                      # slot_mapping after them
        HostPart(array("i", [1, 2, 0, 3, 4, 5]), torch.int32, (3, 2)),        # block tables
        HostPart(torch.tensor([0, 1, 3], dtype=torch.int32), torch.int32),    # cu_seqlens, a tensor
        HostPart(array("i"), torch.int32, (0, 2)),                            # no prefill rows
    ]


# --- select_device -------------------------------------------------------------------------


def test_cpu_is_selected_as_it_is():
    assert select_device("cpu") == CPU


@pytest.mark.parametrize("bad", ["cuda:x", "tpu", "mps"])
def test_a_device_pdserve_does_not_run_on_is_refused(bad):
    with pytest.raises(ValueError, match="--device"):
        select_device(bad)


def fake_gpus(monkeypatch, count: int) -> list[int]:
    current = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: current.__setitem__(0, i))
    return current


def test_cuda_n_becomes_the_current_device(monkeypatch):
    current = fake_gpus(monkeypatch, 2)
    assert select_device("cuda:1") == torch.device("cuda", 1)
    assert current == [1]


def test_plain_cuda_is_the_current_device(monkeypatch):
    fake_gpus(monkeypatch, 2)
    assert select_device("cuda") == torch.device("cuda", 0)


def test_a_device_index_past_the_last_gpu_says_which_exist(monkeypatch):
    fake_gpus(monkeypatch, 2)
    with pytest.raises(ValueError, match=r"2 CUDA device\(s\), cuda:0 to cuda:1"):
        select_device("cuda:2")


def test_cuda_without_a_gpu_says_to_use_the_cpu(monkeypatch):
    fake_gpus(monkeypatch, 0)
    with pytest.raises(ValueError, match="--device cpu"):
        select_device("cuda")


# --- the packed upload ---------------------------------------------------------------------


def test_every_part_starts_on_a_16_byte_boundary_even_after_odd_int32_parts():
    spans, total = layout(step_parts())
    assert [s.offset for s in spans] == [0, 32, 64, 80, 112, 144, 160]
    assert all(s.offset % ALIGN == 0 for s in spans) and total == 160
    assert spans[3].dtype == torch.int64 and spans[2].nbytes == 12  # int64 right after 3 int32


def test_a_packed_upload_returns_each_part_with_its_values_dtype_and_shape():
    parts = step_parts()
    got = StepUploader(CPU, packed=True).upload(parts)
    want = [torch.tensor([5, 6, 7]), torch.tensor([10, 11, 12]), torch.tensor([3, 4, 5], dtype=torch.int32),
            torch.tensor([40, 41, 42]), torch.tensor([[1, 2], [0, 3], [4, 5]], dtype=torch.int32),
            torch.tensor([0, 1, 3], dtype=torch.int32), torch.empty(0, 2, dtype=torch.int32)]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)


def test_a_packed_upload_is_one_buffer_of_views():
    got = StepUploader(CPU, packed=True).upload(step_parts())
    base = got[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in got)
    assert all(t.data_ptr() % ALIGN == 0 for t in got)


def test_the_packing_buffer_is_kept_and_grown_only_when_a_step_needs_more():
    uploader = StepUploader(CPU, packed=True)
    uploader.upload(step_parts())
    first = uploader.host_buffer
    uploader.upload(step_parts()[:2])
    assert uploader.host_buffer is first
    big = [HostPart(array("q", range(20_000)), torch.int64)]
    assert torch.equal(uploader.upload(big)[0], torch.arange(20_000))
    assert uploader.host_buffer is not first and uploader.host_buffer.numel() >= 160_000


def test_on_the_cpu_an_upload_copies_nothing():
    ids = array("q", [5, 6, 7])
    table = array("i", [1, 2, 0, 3])
    got_ids, got_table = StepUploader(CPU).upload([HostPart(ids, torch.int64), HostPart(table, torch.int32, (2, 2))])
    assert got_ids.data_ptr() == ids.buffer_info()[0] and got_table.data_ptr() == table.buffer_info()[0]
    assert got_table.tolist() == [[1, 2], [0, 3]]
    empty, rows = StepUploader(CPU).upload([HostPart(array("q"), torch.int64),
                                            HostPart(torch.zeros(0, 3, dtype=torch.int32), torch.int32)])
    assert empty.shape == (0,) and empty.dtype == torch.int64 and rows.shape == (0, 3)


def test_a_tensor_part_keeps_its_shape_and_a_slice_of_rows_goes_up_as_it_is():
    table = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    decode_rows, prefill_rows = StepUploader(CPU, packed=True).upload(
        [HostPart(table[:1], torch.int32), HostPart(table[1:], torch.int32)])
    assert decode_rows.tolist() == [[1, 2]] and prefill_rows.tolist() == [[3, 4], [5, 6]]
    assert prefill_rows.data_ptr() % ALIGN == 0


def test_a_part_whose_values_are_not_of_its_dtype_is_refused():
    with pytest.raises(ValueError, match="typecode 'i'"):
        StepUploader(CPU, packed=True).upload([HostPart(array("i", [1]), torch.int64)])
    with pytest.raises(ValueError, match="shape"):
        layout([HostPart(array("i", [1, 2, 3]), torch.int32, (2, 2))])
    # The CPU path checks the same without packing.
    with pytest.raises(ValueError, match="typecode 'i'"):
        StepUploader(CPU).upload([HostPart(array("i", [1]), torch.int64)])
    with pytest.raises(ValueError, match="tensor of torch.int64"):
        StepUploader(CPU).upload([HostPart(torch.zeros(2, dtype=torch.int32), torch.int64)])


@pytest.mark.gpu
@needs_cuda
def test_on_cuda_a_step_goes_up_from_one_pinned_buffer():
    uploader = StepUploader(torch.device("cuda"))
    got = uploader.upload(step_parts())
    assert uploader.host_buffer is not None and uploader.host_buffer.is_pinned()
    assert all(t.is_cuda for t in got)
    assert got[4].cpu().tolist() == [[1, 2], [0, 3], [4, 5]] and got[3].cpu().tolist() == [40, 41, 42]
    again = uploader.upload(step_parts()[:1])  # waits for the first copy before packing again
    assert again[0].cpu().tolist() == [5, 6, 7]


# --- the KV stream -------------------------------------------------------------------------


def test_the_cpu_has_no_kv_stream():
    assert kv_stream(CPU) is None
    with on_kv_stream(CPU):
        pass


def test_each_gpu_has_one_kv_stream_and_kv_work_runs_on_it(monkeypatch):
    made, entered = [], []
    monkeypatch.setattr(device_module, "_kv_streams", {})
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(device) or SimpleNamespace(device=device))

    @contextlib.contextmanager
    def stream(s):
        entered.append(s)
        yield

    monkeypatch.setattr(torch.cuda, "stream", stream)
    one = kv_stream(torch.device("cuda", 1))
    assert kv_stream(torch.device("cuda", 1)) is one and kv_stream(torch.device("cuda", 0)) is not one
    with on_kv_stream(torch.device("cuda", 1)):
        assert entered == [one]
    assert made == [torch.device("cuda", 1), torch.device("cuda", 0)]


@pytest.mark.gpu
@needs_cuda
def test_the_kv_stream_is_not_the_engines():
    stream = kv_stream(torch.device("cuda"))
    assert stream is not None and stream != torch.cuda.current_stream()
    with on_kv_stream(torch.device("cuda")):
        assert torch.cuda.current_stream() == stream


# --- the KV cache's size -------------------------------------------------------------------


def cuda_config(**kw) -> EngineConfig:
    return EngineConfig(device="cuda:0", dtype="bfloat16", **kw)


def free_memory(monkeypatch, free: int, total: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))


def test_on_the_cpu_the_cache_is_one_gigabyte_unless_set():
    per_block = kv_block_bytes(MODEL, 16, torch.float32)
    assert EngineConfig().kv_cache_memory_gb == 1.0
    assert kv_cache_blocks(EngineConfig(), MODEL, torch.float32, 0) == GiB // per_block
    assert kv_cache_blocks(EngineConfig(kv_cache_memory_gb=0.5), MODEL, torch.float32, 0) == GiB // 2 // per_block


def test_on_cuda_the_cache_is_the_utilized_memory_less_what_is_in_use_and_the_weights(monkeypatch):
    free_memory(monkeypatch, free=70 * GiB, total=80 * GiB)
    per_block = kv_block_bytes(MODEL, 16, torch.bfloat16)
    blocks = kv_cache_blocks(cuda_config(), MODEL, torch.bfloat16, weights_bytes=2 * GiB)
    assert blocks == (int(80 * GiB * 0.9) - 10 * GiB - 2 * GiB) // per_block
    half = kv_cache_blocks(cuda_config(gpu_memory_utilization=0.45), MODEL, torch.bfloat16, weights_bytes=2 * GiB)
    assert half == (int(80 * GiB * 0.45) - 10 * GiB - 2 * GiB) // per_block


def test_on_cuda_an_explicit_size_wins_over_the_device(monkeypatch):
    free_memory(monkeypatch, free=70 * GiB, total=80 * GiB)
    per_block = kv_block_bytes(MODEL, 16, torch.bfloat16)
    assert kv_cache_blocks(cuda_config(kv_cache_memory_gb=1.0), MODEL, torch.bfloat16, 0) == GiB // per_block
    assert kv_cache_blocks(cuda_config(num_kv_blocks=7), MODEL, torch.bfloat16, 0) == 7


def test_a_device_too_full_for_one_block_says_what_to_change(monkeypatch):
    free_memory(monkeypatch, free=GiB, total=80 * GiB)
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.9 .* --kv-cache-memory-gb"):
        kv_cache_blocks(cuda_config(), MODEL, torch.bfloat16, weights_bytes=0)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.01])
def test_the_utilization_must_be_a_fraction(bad):
    with pytest.raises(ConfigError, match="--gpu-memory-utilization"):
        EngineConfig(gpu_memory_utilization=bad)


def test_weights_take_their_serving_dtypes_bytes():
    state = {"a": torch.zeros(3, 4), "b": torch.zeros(5)}
    assert weights_bytes(state, torch.bfloat16) == 17 * 2
