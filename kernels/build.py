"""Compiles the CPU kernels (kernels/csrc) into one shared library per instruction-set variant.

    python -m pdserve.kernels.build --variants all --out DIR

The one place that knows how the kernels compile: the wheel (setup.py, hence the Docker image)
builds the variants of kernels/variants.py with it, and kernels/cpu_ops.py builds `native`
(`-march=native`, for the machine that runs it) with it where no prebuilt variant is installed.
Every variant asked for goes into one ninja graph, so their sources compile in parallel. The
include and library paths are torch's own (torch.utils.cpp_extension); the libraries register
their ops when loaded with torch.ops.load_library and are not Python modules.

Next to the libraries, `_cpu_build.json` records the torch version they were compiled against
and a digest of the sources: a library built for another torch (whose C++ ABI it uses) or from
other sources (a checkout's, since edited) is not loaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from pdserve.kernels.variants import VARIANTS, by_name, cpu_flags, supported

__all__ = ["NATIVE", "BuildError", "Manifest", "build", "cflags", "library_name", "read_manifest", "sources"]

CSRC = Path(__file__).parent / "csrc"
NATIVE = "native"  # the build for the machine that compiles it (kernels/cpu_ops.py's fallback)
MANIFEST = "_cpu_build.json"
# -std=c++20 and -fPIC as torch.utils.cpp_extension compiles; -fopenmp because at::parallel_for
# is inline OpenMP code (without it the kernels would run on one thread).
COMMON_FLAGS = ("-std=c++20", "-fPIC", "-O3", "-fopenmp", "-fno-math-errno")


class BuildError(RuntimeError):
    """The compiler or ninja is missing, or the build failed (the message holds its output's tail)."""


def sources() -> list[Path]:
    """The translation units: every .cpp in kernels/csrc (bindings.cpp registers the ops)."""
    return sorted(CSRC.glob("*.cpp"))


def cflags(variant: str) -> list[str]:
    """The compiler flags of a variant (or `native`), besides the include paths."""
    isa = ["-march=native"] if variant == NATIVE else list(by_name(variant).cflags)
    return [*COMMON_FLAGS, *isa]


def library_name(variant: str) -> str:
    """The file a variant's library is, e.g. `_cpu_avx512_bf16.so`."""
    return "_cpu_native.so" if variant == NATIVE else by_name(variant).library


def torch_version() -> str:
    """torch's release without its local tag: the CPU and CUDA builds of a release share the ABI."""
    import torch

    return torch.__version__.split("+")[0]


def sources_hash() -> str:
    """A digest of kernels/csrc: the sources and the headers they share."""
    h = hashlib.sha256()
    for src in sorted(CSRC.glob("*.[ch]*")):
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    return h.hexdigest()[:16]


class Manifest(NamedTuple):
    """What `_cpu_build.json` records of the libraries beside it."""

    torch: str | None
    sources: str | None
    variants: list[str]


def read_manifest(directory: Path) -> Manifest:
    try:
        data = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return Manifest(None, None, [])
    return Manifest(data.get("torch"), data.get("sources"), list(data.get("variants", [])))


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None and name == "ninja":  # the `ninja` wheel, where its bin/ is not on PATH
        try:
            import ninja  # type: ignore[import-not-found]

            found = shutil.which("ninja", path=ninja.BIN_DIR)
        except ImportError:
            pass
    if found is None:
        what = "a C++ compiler" if name != "ninja" else "ninja (pip install ninja)"
        raise BuildError(f"the CPU kernels need {what}: {name!r} is not on PATH")
    return found


def _escape(path: Path | str) -> str:
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def include_flags() -> list[str]:
    """torch's headers, and the C++ ABI torch was built with."""
    import torch
    from torch.utils import cpp_extension

    flags = [f for p in cpp_extension.include_paths() for f in ("-isystem", p)]
    return [*flags, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"]


def _ninja_file(variants: Sequence[str], cxx: str) -> str:
    from torch.utils import cpp_extension

    includes = " ".join(shlex.quote(f) for f in include_flags()).replace("$", "$$")
    libs = " ".join(f"-L{shlex.quote(p)}" for p in cpp_extension.library_paths()).replace("$", "$$")
    lines = [
        "ninja_required_version = 1.3",
        f"cxx = {shlex.quote(cxx)}",
        f"includes = {includes}",
        f"ldflags = -shared -fopenmp {libs} -lc10 -ltorch_cpu -ltorch",
        "rule compile",
        "  command = $cxx -MMD -MF $out.d $includes $cflags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = compile $out",
        "rule link",
        "  command = $cxx $in $ldflags -o $out",
        "  description = link $out",
    ]
    for variant in variants:
        objects = []
        for src in sources():
            obj = f"{variant}/{src.stem}.o"
            objects.append(obj)
            lines += [f"build {obj}: compile {_escape(src)}", f"  cflags = {' '.join(cflags(variant))}"]
        lines.append(f"build {library_name(variant)}: link {' '.join(objects)}")
    return "\n".join(lines) + "\n"


def build(variants: Sequence[str], out: Path, *, build_dir: Path | None = None, cxx: str = "c++",
          jobs: int | None = None) -> dict[str, Path]:
    """Compile `variants` (names of kernels/variants.py, or `native`) into `out`; returns each
    one's library. `build_dir` keeps the objects for the next build (a temporary one by default)."""
    if not variants:
        return {}
    for v in variants:
        library_name(v)  # an unknown name fails here, before anything compiles
    cxx, ninja = _tool(cxx), _tool("ninja")
    with tempfile.TemporaryDirectory(prefix="pdserve-kernels-") as scratch:
        where = Path(build_dir or scratch)
        where.mkdir(parents=True, exist_ok=True)
        text = _ninja_file(variants, cxx)
        ninja_file = where / "build.ninja"
        if not ninja_file.exists() or ninja_file.read_text() != text:  # unchanged: ninja keeps its state
            ninja_file.write_text(text)
        cmd = [ninja, "-C", str(where), *(["-j", str(jobs)] if jobs else [])]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise BuildError(f"the CPU kernels failed to compile ({' '.join(variants)}):\n"
                             + (run.stdout + run.stderr)[-6000:])
        out.mkdir(parents=True, exist_ok=True)
        built = {}
        for v in variants:
            built[v] = out / library_name(v)
            if built[v] != where / library_name(v):
                tmp = built[v].with_suffix(".so.tmp")  # a reader never sees half a library
                shutil.copyfile(where / library_name(v), tmp)
                tmp.replace(built[v])
    prebuilt = [v for v in variants if v != NATIVE]
    if prebuilt:
        _record(out, prebuilt)
    return built


def _record(out: Path, variants: list[str]) -> None:
    """Add `variants` to out's manifest (a new one where torch or the sources changed)."""
    now = Manifest(torch_version(), sources_hash(), [])
    before = read_manifest(out)
    known = before.variants if before[:2] == now[:2] else []
    names = [v for v in VARIANTS if v in {*known, *variants}]
    record = {"torch": now.torch, "sources": now.sources, "variants": names}
    (out / MANIFEST).write_text(json.dumps(record, indent=1) + "\n")


def resolve(spec: str) -> list[str]:
    """`all`, `best` (the best variant this CPU runs), `none`, or names separated by commas."""
    if spec == "all":
        return list(VARIANTS)
    if spec == "none":
        return []
    if spec == "best":
        best = supported(cpu_flags())[:1]
        if not best:
            raise BuildError("this CPU runs none of the prebuilt variants; build `native` instead")
        return best
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for n in names:
        library_name(n)
    return names


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m pdserve.kernels.build`: compile variants of the CPU kernels into a folder."""
    p = argparse.ArgumentParser(prog="python -m pdserve.kernels.build", description=main.__doc__)
    p.add_argument("--variants", default="all",
                   help=f"all, best, none, or a comma-separated list of {', '.join(VARIANTS)}, {NATIVE}")
    p.add_argument("--out", type=Path, default=Path(__file__).parent,
                   help="where the libraries go (default: next to this module, where cpu_ops looks)")
    p.add_argument("--build-dir", type=Path, default=None, help="keep the objects here for the next build")
    p.add_argument("--cxx", default="c++", help="the C++ compiler")
    p.add_argument("-j", "--jobs", type=int, default=None, help="parallel compiles (default: ninja's)")
    args = p.parse_args(argv)
    start = time.monotonic()
    try:
        built = build(resolve(args.variants), args.out, build_dir=args.build_dir, cxx=args.cxx, jobs=args.jobs)
    except (BuildError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    for v, lib in built.items():
        print(f"{v}: {lib}")
    print(f"built {len(built)} variant(s) in {time.monotonic() - start:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
