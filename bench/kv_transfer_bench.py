"""KV transfer throughput per transport, next to a plain torch copy of the same bytes.

    python -m pdserve.bench.kv_transfer_bench [--sizes-mb 1,16,64] [--repeats 5] [--transports tcp,shm]

For each size, one sender and one receiver in this process (one host, loopback). "deliver" is
send() until the receiver hands out the verified payload (staging copy, both checksums, the
socket); "round trip" adds the engine's copy-in (`scatter_blocks`) and the ack's return. Beside
them, the same run's limits: a torch copy of the same bytes (what shm is held to) and a plain
loopback TCP socket moving them (what tcp is held to).
Medians over the repeats. Every option `--foo-bar` defaults to $PDSERVE_FOO_BAR when set.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

import torch

from pdserve.config.envs import flag_default
from pdserve.engine.kv_cache import scatter_blocks
from pdserve.kvtransfer.tensors import checksum, describe
from pdserve.kvtransfer.transport import available_kinds, make_receiver, make_sender
from pdserve.protocol.messages import KVTransfer, ModelFingerprint
from pdserve.protocol.sampling import SamplingParams

# 16 layers x (K, V) x 16 tokens x 8 heads x 64 dims x 4 bytes = 1 MiB per block (float32).
_FP = ModelFingerprint(
    "bench", "llama", num_layers=16, num_kv_heads=8, head_dim=64, dtype="float32", block_size=16
)



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


def bench_transport(kind: str, num_blocks: int, repeats: int, device: str) -> tuple[float, float]:
    """Median seconds (deliver, round trip) for one payload of `num_blocks` MiB-blocks."""
    fp = _FP
    payload = _payload(num_blocks, fp, device)
    cache = torch.zeros(
        (fp.num_layers, 2, num_blocks, *payload.shape[3:]), dtype=payload.dtype, device=device
    )
    ids = list(range(num_blocks))
    deliver, round_trip = [], []
    with (
        make_receiver(kind, "tcp://127.0.0.1:0", fingerprint=fp) as rx,
        make_sender(kind, lease_s=30.0) as tx,
    ):
        for i in range(repeats + 1):  # the first one warms up (connect, segment creation)
            rid = f"bench-{i}"
            t0 = time.perf_counter()
            tx.send(rx.address, _meta(payload, fp, rid), payload)
            (got,) = rx.poll(timeout=60)
            t1 = time.perf_counter()
            if not got.ok or got.payload is None:
                raise RuntimeError(f"{kind}: transfer refused: {got.reason}")
            scatter_blocks(cache, ids, got.payload)
            rx.ack(rid, True)
            (ack,) = tx.poll_acks(timeout=60)
            t2 = time.perf_counter()
            if i:
                deliver.append(t1 - t0)
                round_trip.append(t2 - t0)
    return statistics.median(deliver), statistics.median(round_trip)


def bench_copy(num_blocks: int, repeats: int, device: str) -> float:
    src = _payload(num_blocks, _FP, device)
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


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

    times = []
    try:
        for i in range(repeats + 1):
            reader = threading.Thread(target=receive)
            t0 = time.perf_counter()
            reader.start()
            client.sendall(data)
            reader.join()
            if i:
                times.append(time.perf_counter() - t0)
    finally:
        for sock in (client, conn, server):
            sock.close()
    return statistics.median(times)


def bench_checksum(num_blocks: int, algorithm: str, device: str) -> float:
    t = _payload(num_blocks, _FP, device)
    checksum(t, algorithm)
    t0 = time.perf_counter()
    checksum(t, algorithm)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes-mb", default=flag_default("sizes-mb", "1,16,64"), help="payload sizes in MiB")
    p.add_argument("--repeats", type=int, default=flag_default("repeats", 5))
    p.add_argument("--transports", default=flag_default("transports", ",".join(available_kinds())))
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes_mb.split(",") if s]
    kinds = [k for k in args.transports.split(",") if k]

    rows: list[tuple[str, int, float, float | None]] = []
    for mb in sizes:
        nbytes = mb << 20
        for device in ["cpu"] + (["cuda"] if "cuda_ipc" in kinds else []):
            rows.append(
                (
                    f"torch copy ({device})",
                    mb,
                    _gbps(nbytes, bench_copy(mb, args.repeats, device)),
                    None,
                )
            )
        if "tcp" in kinds:
            rows.append(("loopback socket", mb, _gbps(nbytes, bench_socket(mb, args.repeats)), None))
        for algorithm, device in [("crc32", "cpu"), ("wsum64", "cpu")] + (
            [("wsum64", "cuda")] if "cuda_ipc" in kinds else []
        ):
            rows.append(
                (
                    f"checksum {algorithm} ({device})",
                    mb,
                    _gbps(nbytes, bench_checksum(mb, algorithm, device)),
                    None,
                )
            )
        for kind in kinds:
            device = "cuda" if kind == "cuda_ipc" else "cpu"
            deliver, rt = bench_transport(kind, mb, args.repeats, device)
            rows.append((kind, mb, _gbps(nbytes, deliver), _gbps(nbytes, rt)))

    print(f"{'what':<26} {'MiB':>5} {'deliver GB/s':>13} {'round trip GB/s':>16}")
    for what, mb, a, b in rows:
        print(f"{what:<26} {mb:>5} {a:>13.2f} {'' if b is None else f'{b:.2f}':>16}")


if __name__ == "__main__":
    main()
