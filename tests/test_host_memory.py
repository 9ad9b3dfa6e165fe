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

