"""Loads the compiled CPU kernels, torch.ops.pdserve_cpu, from one shared library.

`load("auto")` takes the best prebuilt variant this CPU runs (kernels/variants.py), as ggml picks
its CPU variants: the wheel and the Docker image ship every variant (kernels/build.py, setup.py),
so a pod starts without a compiler. Where none is installed (a checkout), it compiles the kernels
for this machine (`-march=native`) once, caches the build per CPU, torch version and sources
under ~/.cache/pdserve/kernels (`cache_dir` elsewhere), and other processes wait on the build's
lock; `make setup` does it ahead (`python -m pdserve.kernels.cpu_ops`). Where that fails too, it
returns None after one warning and the PyTorch reference (kernels/reference.py) runs; it stays the
oracle either way. `require=True` turns that fallback into an error.

A variant named explicitly is that library or an error. A process loads one library: the first
call decides, later calls get its result, and a later call naming another variant is an error.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import logging
import platform
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from pdserve.kernels import build
from pdserve.kernels.variants import VARIANTS, by_name, cpu_flags, cpu_supports, supported

__all__ = ["CHOICES", "VARIANTS", "choose", "cpu_supports", "installed_variants", "load", "loaded_variant"]

log = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).parent  # where the wheel puts the prebuilt libraries
SOURCES = build.sources()
NATIVE = build.NATIVE
CHOICES = ("auto", *VARIANTS, NATIVE, "off")


class _Loaded(NamedTuple):
    request: str
    variant: str | None  # a variant's name, "native", or None (nothing loaded)
    ops: object | None
    library: Path | None


_lock = threading.Lock()
_loaded: _Loaded | None = None


def installed_variants(directory: Path = PACKAGE_DIR) -> list[str]:
    """The prebuilt variants in `directory` built for this torch from these sources, best first."""
    found = build.read_manifest(directory)
    if found.torch is None:
        return []
    if found.torch != build.torch_version():
        log.warning("the prebuilt CPU kernels in %s are for torch %s, this is torch %s: not loading them",
                    directory, found.torch, build.torch_version())
        return []
    if found.sources != build.sources_hash():
        log.warning("the prebuilt CPU kernels in %s were built from other sources: not loading them", directory)
        return []
    return [v for v in VARIANTS if v in found.variants and (directory / by_name(v).library).is_file()]


def choose(request: str, flags: Collection[str], installed: Collection[str]) -> str | None:
    """What load(request) loads on a CPU with these flags where these variants are installed: a
    variant, "native" (the build for this machine) or None ("off"). An explicit variant that is
    not installed, or that the CPU cannot run, raises RuntimeError."""
    if request not in CHOICES:
        raise ValueError(f"unknown CPU kernels {request!r}; choose one of {', '.join(CHOICES)}")
    if request == "off":
        return None
    if request == NATIVE:
        return NATIVE
    runs = supported(frozenset(flags))
    if request == "auto":
        return next((v for v in runs if v in installed), NATIVE)
    if request not in runs:
        missing = " ".join(sorted(by_name(request).needs - set(flags)))
        raise RuntimeError(f"this CPU cannot run the {request!r} CPU kernels (it lacks {missing}); it runs "
                           f"{', '.join(runs) or 'none of the prebuilt variants'} ('auto' picks the best)")
    if request not in installed:
        raise RuntimeError(f"the {request!r} CPU kernels are not installed (installed: {', '.join(installed) or 'none'}); "
                           f"build them with `python -m pdserve.kernels.build --variants {request}`, or ask for 'auto'")
    return request


def load(variant: str = "auto", *, require: bool = False, cache_dir: Path | None = None) -> object | None:
    """torch.ops.pdserve_cpu from the library `variant` names (see the module docstring), or None
    where "off", or where "auto" found no kernels and `require` is false."""
    global _loaded
    if variant not in CHOICES:
        raise ValueError(f"unknown CPU kernels {variant!r}; choose one of {', '.join(CHOICES)}")
    with _lock:
        if _loaded is None:
            _loaded = _load(variant, require, cache_dir)
        elif variant not in ("auto", _loaded.request, _loaded.variant):
            raise RuntimeError(f"this process already loaded the {_loaded.variant or 'no'} CPU kernels "
                               f"(asked for {_loaded.request!r}); it cannot load {variant!r} too")
        if _loaded.ops is None and require:
            raise RuntimeError("the compiled CPU kernels are required, but none loaded (see the log)")
        return _loaded.ops


def loaded_variant() -> str | None:
    """What load() loaded in this process: a variant's name, "native", or None."""
    return None if _loaded is None else _loaded.variant


def _load(request: str, require: bool, cache_dir: Path | None) -> _Loaded:
    pick = choose(request, cpu_flags(), installed_variants())
    if pick is None:
        return _Loaded(request, None, None, None)
    if pick != NATIVE:
        library = PACKAGE_DIR / by_name(pick).library
        try:
            return _Loaded(request, pick, _load_library(library), library)
        except OSError as exc:  # not loadable here after all: the build for this machine then
            if request != "auto":
                raise RuntimeError(f"the {pick!r} CPU kernels did not load: {exc}") from exc
            log.warning("the prebuilt %s CPU kernels did not load (%s); building them for this machine", pick, exc)
    try:
        library = _build_native(cache_dir)
        return _Loaded(request, NATIVE, _load_library(library), library)
    except Exception as exc:  # a missing compiler, a failed build: the reference runs instead
        if request == NATIVE or require:
            raise RuntimeError(f"the compiled CPU kernels are required but failed to build: {exc}") from exc
        log.warning("compiled CPU kernels unavailable (%s); using the PyTorch reference attention", exc)
        return _Loaded(request, None, None, None)


def _load_library(library: Path) -> object:
    torch.ops.load_library(str(library))
    log.info("CPU kernels loaded from %s", library)
    return torch.ops.pdserve_cpu


# --- the build for this machine ----------------------------------------------------------------


def _cpu_signature() -> str:
    """The CPU's model name and flags: a build made for one CPU is never loaded on another."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))  # one copy of each line, whatever the core count


def build_key() -> str:
    """The build for this machine's cache key: torch, the CPU, the flags and the sources."""
    h = hashlib.sha256()
    for part in (torch.__version__, _cpu_signature(), " ".join(build.cflags(NATIVE)), build.sources_hash()):
        h.update(part.encode())
    return h.hexdigest()[:16]


def native_build_dir(cache_dir: Path | None = None) -> Path:
    """Where the build for this machine lives: under `cache_dir`, ~/.cache/pdserve/kernels by default."""
    root = cache_dir if cache_dir is not None else Path.home() / ".cache" / "pdserve" / "kernels"
    return root / f"cpu-{build_key()}"


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, or when the process dies
        yield


def _build_native(cache_dir: Path | None) -> Path:
    where = native_build_dir(cache_dir)
    where.mkdir(parents=True, exist_ok=True)
    library = where / build.library_name(NATIVE)
    with _exclusive(where / "build.lock"):  # one process builds, the others wait and load it
        if not library.is_file():
            start = time.monotonic()
            log.info("compiling the CPU kernels for this machine into %s (once per machine)", where)
            build.build([NATIVE], where, build_dir=where / "build")  # the library lands whole
            log.info("CPU kernels compiled in %.1f s", time.monotonic() - start)
    return library


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m pdserve.kernels.cpu_ops`: load (building where needed) the CPU kernels and say which."""
    p = argparse.ArgumentParser(prog="python -m pdserve.kernels.cpu_ops", description=main.__doc__)
    p.add_argument("--variant", default="auto", choices=CHOICES, help="which library (default: auto)")
    p.add_argument("--require", action="store_true", help="fail where no compiled kernels load")
    p.add_argument("--cache-dir", type=Path, default=None, help="where the build for this machine goes")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.monotonic()
    try:
        ops = load(args.variant, require=args.require, cache_dir=args.cache_dir)
    except (RuntimeError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    if ops is None:
        print("no compiled CPU kernels: the PyTorch reference will run")
        return
    assert _loaded is not None and _loaded.library is not None
    print(f"CPU kernels: {loaded_variant()} ({_loaded.library}), ready in {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    main()
