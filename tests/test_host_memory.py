"""The CPU engine asks glibc to keep a step's large temporaries' memory for the next step
(engine/host_memory.py). What that buys is a benchmark's business (docs/cpu_kernels.md: page faults
and requests/s of a W1 burst); here: the settings are made, once, by every CPU engine."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest
import torch

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or not ctypes.util.find_library("c"),
                           reason="glibc's mallopt")


@glibc
def test_glibc_accepts_the_settings_in_a_fresh_process():
    program = "from pdserve.engine.host_memory import keep_step_memory as k; print(k(), k())"
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["True", "True"]


@glibc
def test_a_cpu_engine_makes_them_before_it_runs(tiny, monkeypatch):
    from pdserve.config.engine import EngineConfig
    from pdserve.engine import host_memory
    from pdserve.engine.engine import Engine

    calls = []
    real = host_memory.keep_step_memory
    monkeypatch.setattr("pdserve.engine.runner.keep_step_memory", lambda: calls.append(1) or real())
    Engine(EngineConfig(model="tiny", num_kv_blocks=16, dtype="float32"), loaded=tiny)
    assert calls == [1]
    assert host_memory._tuned is True


# --- the KV cache on transparent huge pages -----------------------------------------------------


def vm_flags(address: int) -> list[str] | None:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps), if any."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return None


def thp_policy() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except OSError:
        return None


linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps are Linux's")


@linux
def test_zeros_on_huge_pages_is_a_zeroed_writable_tensor_advised_for_huge_pages():
    from pdserve.engine.host_memory import HUGE_PAGE, zeros_on_huge_pages

    shape = (3, 2, 1000, 16, 2, 64)
    t = zeros_on_huge_pages(shape, torch.bfloat16)
    assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.any()
    t[1, 1, 999] = 2.0
    assert t.sum().item() == 2.0 * 16 * 2 * 64
    flags = vm_flags(t.data_ptr())
    assert flags is not None
    # "hg": MADV_HUGEPAGE was taken; kernels without transparent huge pages refuse the advice.
    assert ("hg" in flags) == (thp_policy() is not None)


@linux
def test_a_tensor_smaller_than_a_huge_page_is_plain_zeros():
    from pdserve.engine.host_memory import zeros_on_huge_pages

    t = zeros_on_huge_pages((100, 7), torch.float32)
    assert t.shape == (100, 7) and not t.any()
    assert "hg" not in (vm_flags(t.data_ptr()) or [])


@linux
def test_the_cpu_engines_kv_cache_lives_on_huge_pages_and_outlives_its_mapping_name(tiny):
    import gc

    from pdserve.config.engine import EngineConfig
    from pdserve.engine.engine import Engine

    engine = Engine(EngineConfig(model="tiny", num_kv_blocks=4096, dtype="float32"), loaded=tiny)
    kv = engine.runner.kv_cache
    gc.collect()  # the mmap object is referenced only through the tensor's storage
    kv.view(-1)[-1] = 1.0
    assert kv.view(-1)[-1].item() == 1.0
    assert ("hg" in (vm_flags(kv.data_ptr()) or [])) == (thp_policy() is not None)
