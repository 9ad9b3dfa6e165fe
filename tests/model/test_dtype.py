"""`--dtype auto`: bfloat16 where the device computes it natively, float32 elsewhere."""

from __future__ import annotations

import pytest

from pdserve.config.engine import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.model.config import resolve_dtype

AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
SPR = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_tile amx_bf16 amx_int8\n"


@pytest.mark.parametrize(("flags", "device", "expected"), [
    (AVX2, "cpu", "float32"),
    (ZEN4, "cpu", "bfloat16"),
    (SPR, "cpu", "bfloat16"),
    (AVX2, "cuda", "bfloat16"),
    (AVX2, "cuda:1", "bfloat16"),
])
def test_auto_picks_bfloat16_only_where_it_runs_natively(tmp_path, flags, device, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(flags)
    assert resolve_dtype("auto", device, str(cpuinfo)) == expected


def test_an_explicit_dtype_passes_through_and_an_unreadable_cpuinfo_means_float32(tmp_path):
    assert resolve_dtype("float16", "cpu", str(tmp_path / "missing")) == "float16"
    assert resolve_dtype("auto", "cpu", str(tmp_path / "missing")) == "float32"


def test_the_default_is_auto_and_the_engine_runs_the_resolved_dtype(tiny):
    assert EngineConfig().dtype == "auto"
    engine = Engine(EngineConfig(model="tiny", num_kv_blocks=16), loaded=tiny)
    assert engine.config.dtype == resolve_dtype("auto", "cpu")
    assert engine.runner.dtype.__repr__().endswith(engine.config.dtype)
