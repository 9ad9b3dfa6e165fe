"""A router whose HTTP API listens on a network address fails closed: without an API key it refuses
to start, unless told explicitly that authentication is done in front of it."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pdserve.config import envs
from pdserve.config.engine import ConfigError
from pdserve.config.ports import free_port
from pdserve.config.router import add_router_arguments, router_config

NETWORK_HOST = "10.0.0.7"  # a pod IP: parsing only, nothing binds it


def config_of(argv: list[str], monkeypatch: pytest.MonkeyPatch):
    for name in list(envs.registered()):
        monkeypatch.delenv(name, raising=False)
    p = argparse.ArgumentParser()
    add_router_arguments(p)
    return router_config(p.parse_args(argv))


@pytest.mark.parametrize("host", [NETWORK_HOST, "0.0.0.0", "::", "pdserve-router"])
def test_a_router_on_a_network_address_without_a_key_is_refused(host, monkeypatch):
    with pytest.raises(ConfigError, match="--allow-unauthenticated"):
        config_of(["--host", host], monkeypatch)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_a_loopback_router_needs_no_key(host, monkeypatch):
    assert config_of(["--host", host], monkeypatch).api_key is None


def test_a_key_or_the_explicit_opt_out_lets_a_network_router_start(monkeypatch):
    assert config_of(["--host", NETWORK_HOST, "--api-key", "k"], monkeypatch).api_key == "k"
    assert config_of(["--host", NETWORK_HOST, "--allow-unauthenticated"], monkeypatch).allow_unauthenticated


def test_the_opt_out_is_read_from_its_twin(monkeypatch):
    for name in list(envs.registered()):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PDSERVE_ALLOW_UNAUTHENTICATED", "true")
    p = argparse.ArgumentParser()
    add_router_arguments(p)
    assert router_config(p.parse_args(["--host", NETWORK_HOST])).allow_unauthenticated


def test_pdserve_router_exits_2_before_serving_without_a_key_on_a_network_address():
    env = envs.child_environ(drop=("PDSERVE_API_KEY", "PDSERVE_ALLOW_UNAUTHENTICATED"))
    cmd = [sys.executable, "-m", "pdserve", "router", "--host", "0.0.0.0", "--port", str(free_port()),
           "--control-address", f"tcp://127.0.0.1:{free_port()}", "--insecure"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "no API key" in proc.stderr and "--allow-unauthenticated" in proc.stderr
