"""The instruction-set variants the CPU kernels are built for, and which of them a CPU runs.

Each variant is one shared library (`_cpu_<name>.so`, kernels/build.py), compiled for a baseline
of x86-64 and loaded where the CPU shows every flag of that baseline (ggml picks its CPU variants
the same way). The kernels choose their code paths by the compiler's macros (`__AVX512BF16__`,
`__AMX_TILE__`, ...: kernels/csrc), so a variant's flags decide which paths it holds:

| variant       | baseline                                  | CPUs                               |
|---------------|-------------------------------------------|------------------------------------|
| `amx`         | x86-64-v4 + AVX512-BF16/VNNI + AMX-BF16   | Sapphire Rapids and later          |
| `avx512-bf16` | x86-64-v4 + AVX512-BF16/VNNI              | Zen 4 and later, Cooper Lake       |
| `avx512`      | x86-64-v4 (AVX-512 F/BW/CD/DQ/VL)         | Skylake-X, Ice Lake                |
| `avx2`        | x86-64-v3 (AVX2, FMA, F16C, BMI, LZCNT)   | Haswell and later, Zen 1-3         |

The flags are spelled out rather than taken from a CPU model (`-march=sapphirerapids`), so that
the CPU check asks for exactly the instructions the compiler may emit. No tuning flag: the hot
loops are intrinsics, which tuning does not change.
"""

from __future__ import annotations

import functools
from collections.abc import Set
from dataclasses import dataclass
from pathlib import Path

__all__ = ["VARIANTS", "Variant", "by_name", "cpu_flags", "cpu_supports", "supported"]


@dataclass(frozen=True, slots=True)
class Variant:
    """One build of the kernels: its compiler flags and the /proc/cpuinfo flags it needs."""

    name: str
    cflags: tuple[str, ...]
    needs: frozenset[str]

    @property
    def library(self) -> str:
        """Its shared library's file name, next to this module once built."""
        return f"_cpu_{self.name.replace('-', '_')}.so"


_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"})  # abm: LZCNT
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_BF16 = _V4 | {"avx512_bf16", "avx512_vnni"}

# In preference order: the first one a CPU runs is the one it loads.
_BUILDS: tuple[Variant, ...] = (
    Variant("amx", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16"),
            _BF16 | {"amx_tile", "amx_bf16"}),
    Variant("avx512-bf16", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"), _BF16),
    Variant("avx512", ("-march=x86-64-v4",), _V4),
    Variant("avx2", ("-march=x86-64-v3",), _V3),
)
VARIANTS: tuple[str, ...] = tuple(v.name for v in _BUILDS)


def by_name(name: str) -> Variant:
    """The variant called `name`; ValueError naming the variants for any other name."""
    for v in _BUILDS:
        if v.name == name:
            return v
    raise ValueError(f"unknown CPU kernel variant {name!r}; the variants are {', '.join(VARIANTS)}")


@functools.cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This CPU's instruction-set flags as Linux lists them (none where there is no such file:
    then no prebuilt variant is picked, and the build for this machine runs instead)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_supports(variant: str, flags: Set[str] | None = None) -> bool:
    """Whether a CPU with these flags (this one's by default) runs every instruction of `variant`."""
    return by_name(variant).needs <= (cpu_flags() if flags is None else flags)


def supported(flags: Set[str]) -> list[str]:
    """The variants a CPU with these flags runs, best first."""
    return [v.name for v in _BUILDS if v.needs <= flags]
