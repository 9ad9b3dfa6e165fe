"""Builds and loads the compiled CPU kernels (kernels/csrc/*.cpp) through torch.utils.cpp_extension.

The build runs once per machine and is cached: `-march=native` code is only safe on the CPU that
compiled it, so the cache key holds the CPU's model and instruction-set flags as well as torch's
version and the sources. `make setup` builds it ahead (`python -m pdserve.kernels.cpu_ops`), so a
worker's first start finds it ready; a worker that finds no cached build compiles it itself
(about a minute on 2 cores) while other processes wait on the build's lock.

`load()` returns None, after one warning naming the cause, where no C++ toolchain is found or the
build fails: the PyTorch reference (kernels/reference.py) then runs, and stays the oracle either
way. `PDSERVE_REQUIRE_CPU_KERNELS=1` (CI) turns that fallback into an error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))
REQUIRE_ENV = "PDSERVE_REQUIRE_CPU_KERNELS"
CACHE_ENV = "PDSERVE_KERNEL_CACHE"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_signature() -> str:
    """The CPU's model name and flags: a build made for one CPU is never loaded on another."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))  # one copy of each line, whatever the core count


def build_key() -> str:
    h = hashlib.sha256()
    for part in (torch.__version__, _cpu_signature(), " ".join(FLAGS)):
        h.update(part.encode())
    for src in sorted(CSRC.glob("*.[ch]*")):  # the .cpp files and the headers they share
        h.update(src.read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = os.environ.get(CACHE_ENV) or os.path.join(xdg, "pdserve", "kernels")
    return Path(root) / f"cpu-{build_key()}"


def load() -> object | None:
    """torch.ops.pdserve_cpu once built and loaded, else None (see the module docstring)."""
    with _lock:
        if "ops" in _state:
            return _state["ops"]
        ops = None
        try:
            ops = _build()
        except Exception as exc:  # a missing compiler, a failed build: the reference runs instead
            if os.environ.get(REQUIRE_ENV) == "1":
                raise RuntimeError(f"the compiled CPU kernels are required ({REQUIRE_ENV}=1) but failed to build: {exc}") from exc
            log.warning("compiled CPU kernels unavailable (%s); using the PyTorch reference attention", exc)
        _state["ops"] = ops
        return ops


def _build() -> object:
    from torch.utils import cpp_extension

    build = cache_dir()
    build.mkdir(parents=True, exist_ok=True)
    fresh = not any(build.glob("*.so"))
    start = time.monotonic()
    if fresh:
        log.info("compiling the CPU kernels into %s (once per machine)", build)
    cpp_extension.load(
        name="pdserve_cpu_kernels",
        sources=[str(s) for s in SOURCES],
        extra_cflags=FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
        is_python_module=False,
        verbose=False,
    )
    if fresh:
        log.info("CPU kernels compiled in %.1f s", time.monotonic() - start)
    return torch.ops.pdserve_cpu


def main() -> None:
    """`python -m pdserve.kernels.cpu_ops`: build (or find) the kernels and say where."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.monotonic()
    ops = load()
    if ops is None:
        raise SystemExit("the compiled CPU kernels did not build; the reference attention will run")
    print(f"CPU kernels ready in {cache_dir()} ({time.monotonic() - start:.1f} s)")


if __name__ == "__main__":
    main()
