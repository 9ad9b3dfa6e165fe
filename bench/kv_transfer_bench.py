"""KV transfer throughput per transport, each beside the limit it is held to.

    python -m pdserve.bench.kv_transfer_bench [--sizes-mb 1,16,64] [--repeats 5]
                                              [--transports tcp,shm] [--json PATH]

For each size, one sender and one receiver in this process (one host, loopback), once with the
deployment secret (CURVE handshake and frame MACs: the default deployment) and once `--insecure`.
"deliver" is send() until the receiver hands out the verified payload (the copy into the segment,
both checksums, the socket); "round trip" adds the engine's copy-in (`scatter_blocks`) and the
ack's return. "shm (staged)" gathers the blocks straight into `ShmKVSender.staging` inside the
timed region: in serving that gather is the copy that replaces the one into the segment.
"in parts" sends the payload as the prefill connector does: parts of at most PART_BYTES (16
MiB), each gathered on its own (into a staging segment for shm) and checked on arrival while
the next one travels, the last carried by the transfer itself.

"% of limit" is deliver over the same run's limit: a torch copy of the same bytes for shm (and
cuda_ipc), a plain loopback TCP socket moving them for tcp. The checksum rows give each
algorithm's rate on one core; hmac-sha256 is what a MAC over every payload byte costs.
Medians over the repeats. """

from __future__ import annotations

import argparse
import hashlib
import hmac
import socket
import statistics
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import msgspec
import torch

from pdserve.bench.report import format_table, write_json
from pdserve.engine.kv_cache import gather_blocks, scatter_blocks
from pdserve.kvtransfer.connector import PART_BYTES
from pdserve.kvtransfer.tensors import checksum, describe
from pdserve.kvtransfer.transport import KVSender, available_kinds, make_receiver, make_sender
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import KVPart, KVTransfer, ModelFingerprint
from pdserve.protocol.sampling import SamplingParams

# 16 layers x (K, V) x 16 tokens x 8 heads x 64 dims x 4 bytes = 1 MiB per block (float32).
_FP = ModelFingerprint(
    "bench", "llama", num_layers=16, num_kv_heads=8, head_dim=64, dtype="float32", block_size=16
)
_SECRET = b"x" * 32
COPY_CPU, COPY_CUDA, SOCKET = "torch copy (cpu)", "torch copy (cuda)", "loopback socket"


class Row(NamedTuple):
    """One line of the table; `limit` names the row of the same size this one is held to."""

    what: str
    mib: int
    deliver_gbps: float
    round_trip_gbps: float | None = None
    limit: str | None = None
    pct_of_limit: float | None = None


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _payload(num_blocks: int, fp: ModelFingerprint, device: str) -> torch.Tensor:
    dtype = getattr(torch, fp.dtype)
    shape = (fp.num_layers, 2, num_blocks, fp.block_size, fp.num_kv_heads, fp.head_dim)
    return torch.randn(shape, device=device).to(dtype)


def _meta(payload: torch.Tensor, fp: ModelFingerprint, rid: str) -> KVTransfer:
    n = payload.shape[2] * fp.block_size
    return KVTransfer(
        request_id=rid,
        prefill_worker_id="bench",
        prompt_token_ids=(),
        output_token_ids=(),
        sampling=SamplingParams(),
        num_computed_tokens=n,
        fingerprint=fp,
        tensor=describe(payload, with_checksum=False),
        transport="",
    )


def _auth(secure: bool) -> FrameAuth | None:
    """The deployment's frame auth, one per end as in two processes (None: --insecure)."""
    return FrameAuth.from_secret(_SECRET) if secure else None


def bench_transport(
    kind: str, num_blocks: int, repeats: int, device: str, *, secure: bool, staged: bool = False,
    parts: bool = False,
) -> tuple[float, float]:
    """Median seconds (deliver, round trip) for one payload of `num_blocks` MiB-blocks."""
    fp = _FP
    source = _payload(num_blocks, fp, device)  # a prefill worker's cache, every block sent
    cache = torch.zeros_like(source)  # the decode worker's
    ids = list(range(num_blocks))
    deliver, round_trip = [], []
    with (
        make_receiver(kind, "tcp://127.0.0.1:0", fingerprint=fp, auth=_auth(secure)) as rx,
        make_sender(kind, lease_s=30.0, auth=_auth(secure)) as tx,
    ):
        for i in range(repeats + 1):  # the first one warms up (connect, segment creation)
            rid = f"bench-{i}"
            t0 = time.perf_counter()
            first = _send_parts(tx, rx.address, source, rid, staged) if parts else 0
            payload = _gathered(tx, source, ids[first:], staged) if staged or first else source
            meta = msgspec.structs.replace(_meta(source, fp, rid), tensor=describe(payload, with_checksum=False),
                                           first_block=first, parts=-(-first // PART_BLOCKS))
            tx.send(rx.address, meta, payload)
            del payload  # a staging tensor belongs to the sender once sent
            (got,) = rx.poll(timeout=60)
            t1 = time.perf_counter()
            if not got.ok or got.payload is None:
                raise RuntimeError(f"{kind}: transfer refused: {got.reason}")
            for at, piece in got.pieces():
                scatter_blocks(cache, ids[at : at + piece.shape[2]], piece)
            rx.ack(rid, True)
            (ack,) = tx.poll_acks(timeout=60)
            t2 = time.perf_counter()
            if not ack.ok:
                raise RuntimeError(f"{kind}: transfer failed: {ack.reason}")
            if i:
                deliver.append(t1 - t0)
                round_trip.append(t2 - t0)
    if not torch.equal(cache, source):
        raise RuntimeError(f"{kind}: the decode cache does not hold the blocks sent")
    return statistics.median(deliver), statistics.median(round_trip)


PART_BLOCKS = PART_BYTES >> 20  # the payload's blocks are 1 MiB each


def _gathered(tx: KVSender, source: torch.Tensor, ids: list[int], staged: bool) -> torch.Tensor:
    """These blocks of `source`, gathered (into a staging segment of the sender's where `staged`)."""
    if not staged:
        return gather_blocks(source, ids)
    out = tx.staging((*source.shape[:2], len(ids), *source.shape[3:]), source.dtype)  # type: ignore[attr-defined]
    return gather_blocks(source, ids, out=out)


def _send_parts(tx: KVSender, address: str, source: torch.Tensor, rid: str, staged: bool) -> int:
    """Send every block but the last PART_BLOCKS or fewer as parts; the first block left."""
    n = source.shape[2]
    ahead = (n - 1) // PART_BLOCKS * PART_BLOCKS
    for seq, at in enumerate(range(0, ahead, PART_BLOCKS)):
        piece = _gathered(tx, source, list(range(at, at + PART_BLOCKS)), staged)
        tx.send_part(address, KVPart(request_id=rid, prefill_worker_id="bench", receiver_id="", seq=seq,
                                     first_block=at, total_blocks=n, fingerprint=_FP,
                                     tensor=describe(piece, with_checksum=False), transport=""), piece)
    return ahead


def _median_time(fn: Callable[[], object], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    times = []
    for i in range(repeats + 1):  # the first one warms up
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_copy(num_blocks: int, repeats: int, device: str) -> float:
    src = _payload(num_blocks, _FP, device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    return _median_time(lambda: dst.copy_(src), repeats, sync)


def bench_socket(num_blocks: int, repeats: int, chunk: int = 4 << 20) -> float:
    """Median seconds to move the payload's bytes over a plain loopback TCP connection (one
    sendall, recv_into a preallocated buffer on a thread): the limit the tcp transport is held to."""
    data = memoryview(bytearray(num_blocks << 20))
    sink = bytearray(len(data))
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    for sock in (client, conn):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def receive() -> None:
        view, got = memoryview(sink), 0
        while got < len(sink):
            got += conn.recv_into(view[got:], min(chunk, len(sink) - got))

    def move() -> None:
        reader = threading.Thread(target=receive)
        reader.start()
        client.sendall(data)
        reader.join()

    try:
        return _median_time(move, repeats)
    finally:
        for sock in (client, conn, server):
            sock.close()


def bench_checksum(num_blocks: int, algorithm: str, device: str, repeats: int) -> float:
    t = _payload(num_blocks, _FP, device)
    if algorithm == "hmac-sha256":
        key, data = bytes(32), t.view(torch.uint8).numpy().data
        return _median_time(lambda: hmac.new(key, data, hashlib.sha256).digest(), repeats)
    return _median_time(lambda: checksum(t, algorithm), repeats)


def _with_limits(rows: list[Row]) -> list[Row]:
    """Each transport row with its limit's name and deliver as a percentage of it."""
    rates = {(r.what, r.mib): r.deliver_gbps for r in rows if r.round_trip_gbps is None}
    out = []
    for r in rows:
        if r.round_trip_gbps is not None:
            kind = r.what.split()[0]
            limit = {"tcp": SOCKET, "shm": COPY_CPU, "cuda_ipc": COPY_CUDA}[kind]
            r = r._replace(limit=limit, pct_of_limit=100 * r.deliver_gbps / rates[(limit, r.mib)])
        out.append(r)
    return out


def run(sizes: list[int], kinds: list[str], repeats: int) -> list[Row]:
    rows: list[Row] = []
    for mb in sizes:
        nbytes = mb << 20
        for device in ["cpu"] + (["cuda"] if "cuda_ipc" in kinds else []):
            rows.append(Row(f"torch copy ({device})", mb, _gbps(nbytes, bench_copy(mb, repeats, device))))
        if "tcp" in kinds:
            rows.append(Row(SOCKET, mb, _gbps(nbytes, bench_socket(mb, repeats))))
        for algorithm, device in [("xxh3", "cpu"), ("crc32", "cpu"), ("hmac-sha256", "cpu")] + (
            [("wsum64", "cuda")] if "cuda_ipc" in kinds else []
        ):
            seconds = bench_checksum(mb, algorithm, device, repeats)
            rows.append(Row(f"checksum {algorithm} ({device})", mb, _gbps(nbytes, seconds)))
        for kind in kinds:
            device = "cuda" if kind == "cuda_ipc" else "cpu"
            variants = [(False, False)]  # (staged, in parts): whole, as the transport is given it
            if device == "cpu":  # and as the prefill connector sends it
                variants += [(True, False), (True, True)] if kind == "shm" else [(False, True)]
            for staged, parts in variants:
                for secure in (True, False):
                    deliver, rt = bench_transport(kind, mb, repeats, device, secure=secure, staged=staged, parts=parts)
                    what = kind + (" (staged)" if staged else "") + (" in parts" if parts else "") + (
                        "" if secure else " --insecure")
                    rows.append(Row(what, mb, _gbps(nbytes, deliver), _gbps(nbytes, rt)))
    return _with_limits(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes-mb", default="1,16,64", help="payload sizes in MiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--transports", default=",".join(available_kinds()))
    p.add_argument("--json", default="", help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes_mb.split(",") if s]
    kinds = [k for k in args.transports.split(",") if k]

    rows = run(sizes, kinds, args.repeats)
    print(format_table(
        ["what", "MiB", "deliver GB/s", "round trip GB/s", "% of limit"],
        [(r.what, r.mib, r.deliver_gbps, "" if r.round_trip_gbps is None else r.round_trip_gbps,
          "" if r.pct_of_limit is None else f"{r.pct_of_limit:.0f}%") for r in rows],
    ))
    if args.json:
        write_json(args.json, {"rows": [r._asdict() for r in rows]})


if __name__ == "__main__":
    main()
