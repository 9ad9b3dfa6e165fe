"""The wheels bench/gpu_check.sh installs on a GPU machine that has CUDA, PyTorch and Triton but
no internet: pdserve's other dependencies, and what the device check's tests import.

    python -m pdserve.bench.gpu_wheels download DIR [--python-version 3.12] [--platform P ...] [--all]
    python -m pdserve.bench.gpu_wheels check DIR

`download` takes pyproject.toml's dependencies less torch and triton (the GPU machine's own
builds stay) plus TEST_EXTRAS, has pip download them and everything they need as wheels for that
interpreter and platform into DIR, and leaves out the wheels of what a CUDA PyTorch image already
holds (ON_THE_GPU_IMAGE; `--all` keeps them). It writes DIR/requirements.in, the requirements as
pyproject.toml states them, which the GPU machine installs with `pip install --no-index
--find-links DIR -r DIR/requirements.in` (what is installed there and satisfies them stays), and
DIR/requirements.txt, one `name==version` per wheel in DIR. `check` exits 1 naming what is
missing unless both files are there and every pinned wheel is in DIR (the dry run's check).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent
REQUIREMENTS = "requirements.in"  # what to install: pyproject.toml's specifiers
PINS = "requirements.txt"  # what DIR holds: name==version of each wheel
ON_THE_GPU_MACHINE = {"torch", "triton"}  # preinstalled there, in builds for its CUDA
# What the device check's tests import beyond the runtime (pyproject's `test` extra names them).
TEST_EXTRAS = ("pytest", "pytest-timeout", "pytest-xdist", "transformers", "openai")
# pip matches only the tags it is given: every manylinux up to glibc 2.34 (Ubuntu 22.04, RHEL 9).
PLATFORMS = tuple(f"manylinux_2_{minor}_x86_64" for minor in range(34, 16, -1)) + ("manylinux2014_x86_64",)
# What a CUDA PyTorch image holds besides torch and triton, among what the download pulls in (the
# device machines' image holds each, and newer transformers than the tests need): left out so that
# the folder fits the 64 MiB a device run carries (81 MiB with them, about 15 without).
ON_THE_GPU_IMAGE = frozenset((
    "annotated_doc", "anyio", "certifi", "charset_normalizer", "click", "contourpy", "cycler", "execnet",
    "filelock", "fonttools", "fsspec", "h11", "hf_xet", "httpcore", "httpx", "huggingface_hub", "idna",
    "iniconfig", "jinja2", "kiwisolver", "markdown_it_py", "markupsafe", "matplotlib", "mdurl", "ninja", "numpy",
    "packaging", "pillow", "pluggy", "prometheus_client", "protobuf", "pygments", "pyparsing", "pytest",
    "pytest_timeout", "pytest_xdist", "python_dateutil", "pyyaml", "regex", "requests", "rich", "safetensors",
    "shellingham", "six", "tokenizers", "tqdm", "transformers", "typer", "typing_extensions", "urllib3",
))
_WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


def normalized(name: str) -> str:
    """A distribution name as wheel files spell it (PEP 503 folded, then '_')."""
    return re.sub(r"[-_.]+", "_", name).lower()


def requirement_name(spec: str) -> str:
    return normalized(re.split(r"[\s<>=!~;\[]", spec, maxsplit=1)[0])


def requirements(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """The requirement specifiers to download: the runtime's, less ON_THE_GPU_MACHINE, and TEST_EXTRAS'."""
    project = tomllib.loads(pyproject.read_text())["project"]
    tests = {requirement_name(s): s for s in project["optional-dependencies"]["test"]}
    wanted = [s for s in project["dependencies"] if requirement_name(s) not in ON_THE_GPU_MACHINE]
    missing = [name for name in TEST_EXTRAS if normalized(name) not in tests]
    if missing:
        raise SystemExit(f"pyproject.toml's test extra lacks {', '.join(missing)}")
    return wanted + [tests[normalized(name)] for name in TEST_EXTRAS]


def pins(folder: Path) -> list[str]:
    """`name==version` of every wheel in `folder`."""
    out = []
    for wheel in sorted(folder.glob("*.whl")):
        m = _WHEEL.match(wheel.name)
        if m:
            out.append(f"{normalized(m['name'])}=={m['version']}")
    return out


def missing_wheels(folder: Path) -> list[str]:
    """What the folder lacks: its two lists, or the wheel of a pin (empty: complete)."""
    lists = [folder / REQUIREMENTS, folder / PINS]
    absent = [f"{f} (run `make gpu-wheels`)" for f in lists if not f.is_file()]
    if absent:
        return absent
    have = set(pins(folder))
    wanted = [line.strip() for line in lists[1].read_text().splitlines() if line.strip() and not line.startswith("#")]
    if not wanted or not lists[0].read_text().strip():
        return [f"{folder}: an empty requirements list"]
    return [f"the wheel of {pin}" for pin in wanted if pin not in have]


def download(folder: Path, python_version: str, platforms: Sequence[str], keep_all: bool = False) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    wanted = requirements()
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(folder), "--only-binary=:all:",
           "--python-version", python_version, *(f"--platform={p}" for p in platforms), *wanted]
    subprocess.run(cmd, check=True)
    for wheel in folder.glob("*.whl"):
        m = _WHEEL.match(wheel.name)
        name = normalized(m["name"]) if m else ""
        if name in ON_THE_GPU_MACHINE:
            raise SystemExit(f"a dependency pulled in {wheel.name}; torch and triton must not travel")
        if not keep_all and name in ON_THE_GPU_IMAGE:
            wheel.unlink()
    (folder / REQUIREMENTS).write_text("".join(f"{spec}\n" for spec in wanted))
    (folder / PINS).write_text("".join(f"{pin}\n" for pin in pins(folder)))
    size = sum(p.stat().st_size for p in folder.glob("*.whl"))
    print(f"{folder}: {len(pins(folder))} wheels for Python {python_version}, {size / 2**20:.1f} MiB")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.gpu_wheels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("download", help="download the wheels and write DIR's two lists")
    d.add_argument("folder", type=Path, metavar="DIR")
    d.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default: 3.12)")
    d.add_argument("--all", action="store_true", help="keep the wheels of what a CUDA PyTorch image holds too")
    d.add_argument("--platform", action="append",
                   help="a wheel platform tag, repeated for each (default: manylinux 2.17 to 2.34, x86_64)")
    c = sub.add_parser("check", help="exit 1 unless DIR holds its lists and every wheel they pin")
    c.add_argument("folder", type=Path, metavar="DIR")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "download":
        download(args.folder, args.python_version, args.platform or PLATFORMS, keep_all=args.all)
        return 0
    missing = missing_wheels(args.folder)
    if missing:
        print(f"{args.folder}: missing {', '.join(missing)}", file=sys.stderr)
        return 1
    print(f"{args.folder}: {len(pins(args.folder))} wheels, every pinned one there")
    return 0


if __name__ == "__main__":
    sys.exit(main())
