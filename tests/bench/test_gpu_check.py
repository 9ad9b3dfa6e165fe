"""bench/gpu_check.sh --dry-run: on the CPU, without a network, it checks what the device check
carries (the wheel folder, the default model's stand-in) and parses every stage's command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pdserve.bench.gpu_standin import MODEL_DIR, MODEL_FILES, WHEEL
from pdserve.text.model_files import DEFAULT_GGUF_FILENAME, DEFAULT_GGUF_PACKAGE
from tests.helpers.paths import REPO

DEVICE_CALL_LIMIT_S = 600  # one device command's limit: every step's timeout together must fit


@pytest.fixture
def carry(tmp_path) -> tuple[Path, Path]:
    """A wheel folder and a stand-in as `make gpu-wheels` lays them out (the wheels empty files)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "requirements.in").write_text("pyzmq>=25\nmsgspec>=0.18\n")
    (wheels / "requirements.txt").write_text("pyzmq==27.3.0\nmsgspec==0.23.0\n")
    for name in ("pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl", "msgspec-0.23.0-cp312-cp312-manylinux_2_17_x86_64.whl"):
        (wheels / name).touch()
    standin = tmp_path / "standin"
    (standin / MODEL_DIR).mkdir(parents=True)
    with zipfile.ZipFile(standin / WHEEL, "w") as z:
        z.writestr(f"{DEFAULT_GGUF_PACKAGE}/{DEFAULT_GGUF_FILENAME}", b"GGUF")
    for name in MODEL_FILES:
        (standin / MODEL_DIR / name).write_text("{}")
    (standin / MODEL_DIR / "config.json").write_text(json.dumps({"hidden_size": 576, "num_hidden_layers": 30,
                                                                 "vocab_size": 49152}))
    return wheels, standin


def dry_run(wheels: Path, standin: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_CHECK_WHEELS": str(wheels), "GPU_CHECK_STANDIN": str(standin), "PY": sys.executable,
           "OUT": str(tmp_path / "out"), "GPU_CHECK_WORK": str(tmp_path / "work")}
    return subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_dry_run_checks_the_carry_and_parses_every_stage(carry, tmp_path):
    proc = dry_run(*carry, tmp_path)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    out = proc.stdout
    assert "every stage's command parses" in out
    for stage in ("install", "tests", "kernels", "ipc", "service"):
        assert f"[{stage}, timeout" in out
    for what in ("pip install --no-index", "pytest -q -n 8 -m gpu", "tests/kernels/test_triton.py",
                 "kernel_bench --num-heads 9 --num-kv-heads 3 --head-dim 64",
                 "kernel_bench --num-heads 32 --num-kv-heads 8 --head-dim 128", "cuda_ipc_check",
                 "bench compare", "--kv-transport\\ cuda_ipc", "--num-requests 128", "decode_profile"):
        assert what in out, what
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()  # a dry run writes nothing


def test_every_steps_timeout_together_fits_one_device_call(carry, tmp_path):
    out = dry_run(*carry, tmp_path).stdout
    expected, at_most = map(int, re.search(r"expected (\d+) s in all, (\d+) s at most", out).groups())
    assert expected < at_most <= DEVICE_CALL_LIMIT_S - 20


def test_a_missing_wheel_fails_the_dry_run_and_is_named(carry, tmp_path):
    wheels, standin = carry
    next(wheels.glob("msgspec-*.whl")).unlink()
    proc = dry_run(wheels, standin, tmp_path)
    assert proc.returncode == 1 and "msgspec==0.23.0" in proc.stderr


def test_an_incomplete_stand_in_fails_the_dry_run_and_is_named(carry, tmp_path):
    wheels, standin = carry
    (standin / MODEL_DIR / "tokenizer.json").unlink()
    proc = dry_run(wheels, standin, tmp_path)
    assert proc.returncode == 1 and "tokenizer.json is missing" in proc.stderr
