"""The CPU engine asks glibc to keep a step's large temporaries' memory for the next step
(engine/host_memory.py). What that buys is a benchmark's business (docs/cpu_kernels.md: page faults
and requests/s of a W1 burst); here: the settings are made, once, by every CPU engine."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

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



REUSE = """
import ctypes, resource, sys
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
if sys.argv[1] == "tuned":
    from pdserve.engine.host_memory import keep_step_memory
    assert keep_step_memory()
size = 64 * 2**20  # above glibc's largest mmap threshold (32 MB)
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    libc.memset(block, 1, size)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


@glibc
def test_a_block_larger_than_any_mmap_threshold_is_reused_without_faulting_its_pages_in_again():
    """A 64 MB block written, freed and allocated again: glibc's defaults map it afresh each
    time, so its pages fault in again; tuned, the second and third allocations reuse the heap."""
    def faults(mode: str) -> list[int]:
        out = subprocess.run([sys.executable, "-c", REUSE, mode], capture_output=True, text=True, check=True, timeout=120)
        return [int(n) for n in out.stdout.split()]

    huge_pages = 64 * 2**20 // 2**21  # the fewest faults a fresh 64 MB can take: one per 2 MB page
    default, tuned = faults("default"), faults("tuned")
    assert all(n >= huge_pages for n in default), default
    assert all(n < 8 for n in tuned[1:]), tuned
