"""`pdserve up` keeps the API key and the deployment secret off every command line (which `ps`
shows to every local user), and the router it starts still enforces the key."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from pdserve.cli import build_parser
from pdserve.up import plan
from tests.helpers.up_harness import Up

pytestmark = pytest.mark.timeout(240)
KEY = "sk-test-0123456789abcdef"


def test_no_child_of_up_has_the_api_key_on_its_command_line():
    children = plan(build_parser().parse_args(["up", "--api-key", KEY]))
    assert [name for name, argv, _ in children if any(KEY in a for a in argv)] == []


def test_the_router_up_starts_enforces_a_key_it_got_from_the_environment(tiny_dir, tmp_path):
    up = Up(str(tiny_dir), tmp_path / "up.log", num_prefill=1, num_decode=1, env={"PDSERVE_API_KEY": KEY}).start()
    try:
        for child in ("router", "prefill-0", "decode-0"):
            proc = Path(f"/proc/{up.pid(child)}")
            cmdline, environ = proc.joinpath("cmdline").read_bytes(), proc.joinpath("environ").read_bytes().split(b"\0")
            secret = next(v for v in environ if v.startswith(b"PDSERVE_SECRET=")).partition(b"=")[2]
            assert len(secret) >= 16 and secret not in cmdline and KEY.encode() not in cmdline, child
        url, body = f"{up.base_url}/v1/completions", {"prompt": "hello", "max_tokens": 2, "temperature": 0}
        models = httpx.get(f"{up.base_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        body["model"] = models.json()["data"][0]["id"]
        assert httpx.post(url, json=body, timeout=30).status_code == 401
        wrong = {"Authorization": "Bearer not-the-key"}
        assert httpx.post(url, json=body, headers=wrong, timeout=30).status_code == 401
        right = {"Authorization": f"Bearer {KEY}"}
        assert httpx.post(url, json=body, headers=right, timeout=30).status_code == 200
    finally:
        up.stop()
