"""bench/kv_transfer_bench.py: every transport measured with the secret and --insecure (shm also
staged, and both in parts as the prefill connector sends them), each held to the same run's limit
of its size. 17 MiB: one 16 MiB part ahead of the transfer."""

from __future__ import annotations

import json

import pytest

from pdserve.bench import kv_transfer_bench


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv-bench") / "rows.json"
    kv_transfer_bench.main(
        ["--sizes-mb", "17", "--repeats", "1", "--transports", "tcp,shm", "--json", str(path)]
    )
    return {r["what"]: r for r in json.loads(path.read_text())["rows"]}


def test_every_transport_is_measured_with_the_secret_and_insecure(rows):
    transfers = {what for what, r in rows.items() if r["round_trip_gbps"] is not None}
    assert transfers == {
        "tcp", "tcp --insecure", "tcp in parts", "tcp in parts --insecure",
        "shm", "shm --insecure", "shm (staged)", "shm (staged) --insecure",
        "shm (staged) in parts", "shm (staged) in parts --insecure",
    }


def test_each_transfer_is_a_percentage_of_its_limit_of_the_same_run(rows):
    limits = {"tcp": "loopback socket", "shm": "torch copy (cpu)"}
    for what, r in rows.items():
        if r["round_trip_gbps"] is None:
            assert r["limit"] is None and r["pct_of_limit"] is None
            continue
        limit = rows[limits[what.split()[0]]]
        assert r["limit"] == limit["what"] and r["mib"] == limit["mib"] == 17
        assert r["pct_of_limit"] == pytest.approx(100 * r["deliver_gbps"] / limit["deliver_gbps"])
        assert 0 < r["round_trip_gbps"] <= r["deliver_gbps"]


def test_the_checksum_rows_include_xxh3_and_the_mac_it_replaces(rows):
    assert {"checksum xxh3 (cpu)", "checksum crc32 (cpu)", "checksum hmac-sha256 (cpu)"} <= rows.keys()
    assert all(r["deliver_gbps"] > 0 for r in rows.values())
