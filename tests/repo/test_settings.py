"""Settings live in one place: every one a flag with its PDSERVE_* twin, read through one registry
(config/envs.py), listed by --help and passed on by `pdserve up`."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from pdserve.cli import build_parser
from pdserve.config import envs
from pdserve.config.router import (
    RouterConfig,
    add_router_arguments,
    router_argv,
    router_config,
    router_environ,
)
from pdserve.up import plan
from tests.helpers.paths import REPO, package_folders

REGISTRY = REPO / "config" / "envs.py"
# The settings that once existed only as environment variables read deep in the code.
ONCE_HIDDEN = ("cpu-linear", "fused-ops", "kv-prefetch", "kernel-cache", "require-cpu-kernels", "cpu-kernels",
               "attention-backend")


def environment_reads(path: Path) -> list[str]:
    """'file:line what' for each use of os.environ / os.getenv / getenv in a Python or C++ file."""
    text = path.read_text()
    if path.suffix != ".py":
        return [f"{path}:{text.count(chr(10), 0, m.start()) + 1} {m.group(0)}"
                for m in re.finditer(r"\b(secure_)?getenv\s*\(|\benviron\b", text)]
    found = []
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "environb", "getenv", "getenvb", "putenv"):
            found.append(f"{path}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"{path}:{node.lineno} from os import {a.name}" for a in node.names
                      if a.name in ("environ", "environb", "getenv", "getenvb", "putenv")]
    return found


def package_sources() -> list[Path]:
    files = sorted((REPO / "pdserve").glob("*.py"))
    for folder in package_folders().values():
        files += sorted(p for p in folder.rglob("*") if p.suffix in (".py", ".cpp", ".h"))
    return files


def test_nothing_but_the_registry_reads_the_environment():
    reads = [r for f in package_sources() if f != REGISTRY for r in environment_reads(f)]
    assert reads == [], "read the environment through pdserve.config.envs:\n" + "\n".join(reads)


@pytest.mark.parametrize("source", [
    "import os\nx = os.environ.get('PDSERVE_X')\n",
    "import os\nx = os.getenv('PDSERVE_X')\n",
    "from os import environ\nx = environ['PDSERVE_X']\n",
])
def test_the_check_catches_a_read(tmp_path, source):
    f = tmp_path / "planted.py"
    f.write_text(source)
    assert environment_reads(f)


def test_the_check_catches_a_cpp_getenv(tmp_path):
    f = tmp_path / "planted.cpp"
    f.write_text('const char* v = std::getenv("PDSERVE_X");\n')
    assert environment_reads(f)


def test_an_unregistered_variable_cannot_be_read():
    with pytest.raises(KeyError, match="not a registered"):
        envs.get("PDSERVE_NO_SUCH_SETTING")


def help_of(command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command].format_help()


@pytest.mark.parametrize("command", ["prefill", "decode", "generate", "up"])
def test_the_once_hidden_settings_are_flags_with_twins_in_help(command):
    text = " ".join(help_of(command).split())
    for option in ONCE_HIDDEN:
        assert f"--{option}" in text, option
        assert envs.twin_of(option) in text, option


def every_help(parser: argparse.ArgumentParser) -> str:
    """The --help of a parser and of every subcommand under it, whitespace folded."""
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            text += " ".join(every_help(p) for p in action.choices.values())
    return " ".join(text.split())


def test_every_twin_is_the_twin_of_a_flag_that_help_shows():
    text = every_help(build_parser())
    twins = {n: m.removeprefix("the default of ") for n, m in envs.registered().items()
             if m.startswith("the default of")}
    assert len(twins) > 40
    missing = [f"{name} ({flag})" for name, flag in twins.items() if flag not in text]
    assert missing == []


def test_router_flags_default_to_the_dataclass_and_round_trip(monkeypatch):
    for name in list(envs.registered()):
        monkeypatch.delenv(name, raising=False)
    p = argparse.ArgumentParser()
    add_router_arguments(p)
    assert router_config(p.parse_args([])) == RouterConfig()
    custom = RouterConfig(port=9, request_timeout=900.0, prefill_fallback=False, max_model_len=512,
                          api_key="k", header_timeout=2.5, tokenize_threads=3)
    for name, value in router_environ(custom).items():  # the API key: never on argv
        monkeypatch.setenv(name, value)
    p = argparse.ArgumentParser()
    add_router_arguments(p)
    assert router_config(p.parse_args(router_argv(custom))) == custom


def test_a_router_setting_is_read_from_its_twin(monkeypatch):
    monkeypatch.setenv("PDSERVE_REQUEST_TIMEOUT", "900")
    p = argparse.ArgumentParser()
    add_router_arguments(p)
    assert router_config(p.parse_args([])).request_timeout == 900.0


def test_up_passes_router_and_engine_settings_on_as_flags():
    args = build_parser().parse_args(["up", "--request-timeout", "900", "--max-connections", "7",
                                      "--cpu-linear", "onednn", "--no-kv-prefetch", "--no-fused-ops",
                                      "--kernel-cache", "/tmp/k", "--api-key", "sekret"])
    children = dict((name, argv) for name, argv, _ in plan(args))
    router = " ".join(children["router"])
    assert "--request-timeout 900.0" in router and "--max-connections 7" in router
    assert "sekret" not in router and "--kv-transport auto" in router  # the key goes in the environment
    for name in ("prefill-0", "decode-0"):
        worker = " ".join(children[name])
        assert "--cpu-linear onednn" in worker and "--no-kv-prefetch" in worker
        assert "--no-fused-ops" in worker and "--kernel-cache /tmp/k" in worker
