"""The wheel holds the CPU kernels compiled ahead (setup.py, kernels/build.py): installed into a
fresh venv on a machine without a C++ compiler on PATH, it loads the best prebuilt variant its
CPU runs without compiling anything, and `pdserve up` answers /ready and a completion.

To keep CI short the wheel here holds one variant, this CPU's best (`--cpu-variants=best`: about
a minute on 2 cores); tests/kernels/test_variants.py covers the choice among several."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from pdserve.config.ports import free_port
from pdserve.kernels import variants
from tests.helpers.paths import REPO, package_folders

BEST = (variants.supported(variants.cpu_flags()) or [None])[0]
COMPILERS = ("c++", "g++", "gcc", "cc", "clang", "clang++")

pytestmark = [
    pytest.mark.slow,  # builds a wheel with compiled kernels (about 45 s)
    pytest.mark.skipif(BEST is None, reason="this CPU runs none of the prebuilt variants"),
]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel with this CPU's best variant, built from a copy of the sources as a release is."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md", "setup.py"):
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "_cpu_*.so", "_cpu_build.json")
    shutil.copytree(REPO / "pdserve", src / "pdserve", symlinks=True, ignore=ignore)
    for folder in package_folders().values():
        shutil.copytree(folder, src / folder.name, ignore=ignore)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-C--build-option=--cpu-variants=best", "-w", str(out), str(src)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (whl,) = out.glob("pdserve-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed (no deps); the deps are the test environment's,
    visible through a .pth after the venv's own site-packages, so `pdserve` is the wheel's."""
    where = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(where / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, timeout=300, capture_output=True)
    (site,) = where.glob("lib/python*/site-packages")
    (site / "_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return where


def no_compiler_env(venv: Path, home: Path) -> dict[str, str]:
    """This environment with the venv first on PATH, every folder holding a compiler taken off it,
    and HOME elsewhere (where the build for this machine would be cached)."""
    dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not any((Path(d) / c).exists() for c in COMPILERS)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=os.pathsep.join([str(venv / "bin"), *dirs]), HOME=str(home))
    return env


def test_the_wheel_holds_one_library_for_this_cpus_best_variant(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert f"pdserve/kernels/{variants.by_name(BEST).library}" in names
    assert "pdserve/kernels/_cpu_build.json" in names
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl"), "the libraries depend on the platform, not Python"


def test_the_installed_wheel_loads_its_best_variant_without_a_compiler(venv, tmp_path):
    env = no_compiler_env(venv, tmp_path / "home")
    assert all(shutil.which(c, path=env["PATH"]) is None for c in COMPILERS)
    code = ("import json, sys, torch\n"
            "from pdserve.kernels import cpu_ops\n"
            "ops = cpu_ops.load(require=True)\n"
            "x, w = torch.randn(3, 64), torch.randn(64)\n"
            "ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w\n"
            "print(json.dumps({'variant': cpu_ops.loaded_variant(), 'module': cpu_ops.__file__,\n"
            "                  'jit': 'torch.utils.cpp_extension' in sys.modules,\n"
            "                  'right': bool(torch.allclose(ops.rms_norm(x, w, 1e-5), ref, atol=1e-5))}))\n")
    run = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.splitlines()[-1])
    assert Path(got["module"]).is_relative_to(venv), "the wheel's own files, not the checkout's"
    assert got == {**got, "variant": BEST, "jit": False, "right": True}
    assert not (tmp_path / "home" / ".cache").exists(), "nothing was compiled or cached"


def test_pdserve_up_from_the_wheel_answers_ready_without_a_compiler(venv, tiny_dir, tmp_path):
    env = no_compiler_env(venv, tmp_path / "home")
    port = free_port()
    log_path = tmp_path / "up.log"
    cmd = [str(venv / "bin" / "pdserve"), "--log-level", "INFO", "up", "--model", str(tiny_dir), "--port", str(port),
           "--colocated", "--num-decode", "1", "--no-pin", "--threads", "1", "--kv-cache-memory-gb", "0.05"]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, "pdserve up exited:\n" + log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "not ready:\n" + log_path.read_text()[-3000:]
            try:
                if httpx.get(f"{base}/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        model = httpx.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"]
        answer = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 2},
                            timeout=60)
        assert answer.status_code == 200, answer.text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    library = venv.glob(f"lib/python*/site-packages/pdserve/kernels/{variants.by_name(BEST).library}")
    assert f"CPU kernels loaded from {next(library)}" in log, log[-3000:]
    assert "compiling the CPU kernels" not in log
    assert not (tmp_path / "home" / ".cache" / "pdserve").exists(), "nothing was compiled or cached"
