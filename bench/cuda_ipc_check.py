"""A KV hand-off over CUDA IPC between two processes, against a device-to-device copy.

    python -m pdserve.bench.cuda_ipc_check [--sizes-mb 16,64,256] [--repeats 10] [--json PATH]

This process is a prefill worker's sender (kvtransfer's CudaIpcKVSender); a child process it
starts is a decode worker's receiver (CudaIpcKVReceiver). Each transfer goes the way a served
one does: the sender checksums the payload on its device and sends the IPC handle; the child
opens the handle, checksums the payload there, copies it into its own KV cache (scatter_blocks)
and acks. Unlike bench/kv_transfer_bench.py, whose two ends share a process (where CUDA refuses
to open a handle and the receiver reads the staged tensor directly), this is the real handle
path. Per size: the round trip (send to ack), the child's copy into its cache, and beside them
the same bytes copied device-to-device in this process and their wsum64 checksum; GB/s count the
payload's bytes once (the copy reads and writes them: its figure times two is memory traffic).
The payload has Llama-3-8B's KV layout (32 layers, 8 KV heads of 128, bfloat16, blocks of 16
tokens: 2 MiB a block). Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.protocol.messages import KVTransfer, ModelFingerprint
from pdserve.protocol.sampling import SamplingParams

LAYOUT = ModelFingerprint("llama-3-8b-layout", "llama", num_layers=32, num_kv_heads=8, head_dim=128,
                          dtype="bfloat16", block_size=16)
BLOCK_BYTES = 32 * 2 * 16 * 8 * 128 * 2  # 2 MiB


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.cuda_ipc_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", default="16,64,256", help="payload sizes in MiB, multiples of 2 (default 16,64,256)")
    p.add_argument("--repeats", type=int, default=10, help="timed transfers per size, after one untimed (default 10)")
    p.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    p.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)  # the child's side
    args = p.parse_args(argv)
    try:
        args.sizes = [int(s) for s in args.sizes_mb.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes-mb takes MiB counts like 16,64, got {args.sizes_mb!r}")
    if not args.sizes or any(s < 2 or s % 2 for s in args.sizes) or args.repeats < 1:
        p.error("--sizes-mb takes even MiB counts of at least 2, --repeats at least 1")
    return args


def _meta(payload: Any, request_id: str) -> KVTransfer:
    from pdserve.kvtransfer.tensors import describe

    return KVTransfer(request_id=request_id, prefill_worker_id="cuda-ipc-check", prompt_token_ids=(),
                      output_token_ids=(), sampling=SamplingParams(), fingerprint=LAYOUT,
                      num_computed_tokens=payload.shape[2] * LAYOUT.block_size,
                      tensor=describe(payload, with_checksum=False), transport="")


def receive() -> int:
    """The child: a receiver that copies every payload into a cache of its own, then acks; one
    JSON line a transfer on stdout (its copy time); ends when stdin closes."""
    import threading

    import torch

    from pdserve.engine.kv_cache import scatter_blocks
    from pdserve.kvtransfer.transport import make_receiver

    done = threading.Event()

    def wait_for_stdin_to_close() -> None:
        sys.stdin.read()
        done.set()

    threading.Thread(target=wait_for_stdin_to_close, daemon=True).start()
    caches: dict[tuple[int, ...], torch.Tensor] = {}
    with make_receiver("cuda_ipc", "tcp://127.0.0.1:0", fingerprint=LAYOUT) as rx:
        print(rx.address, flush=True)
        while not done.is_set():
            for got in rx.poll(timeout=0.1):
                if not got.ok or got.payload is None:
                    print(json.dumps({"id": got.meta.request_id, "error": got.reason}), flush=True)
                    rx.ack(got.meta.request_id, False, got.reason)
                    continue
                shape = tuple(got.payload.shape)
                cache = caches.setdefault(shape, torch.empty(shape, dtype=got.payload.dtype, device="cuda"))
                torch.cuda.synchronize()
                start = time.perf_counter()
                scatter_blocks(cache, list(range(shape[2])), got.payload)
                torch.cuda.synchronize()
                copy_s = time.perf_counter() - start
                rx.ack(got.meta.request_id, True)
                print(json.dumps({"id": got.meta.request_id, "copy_s": copy_s}), flush=True)
    return 0


def _seconds(fn, repeats: int) -> float:
    import torch

    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(sizes: list[int], repeats: int) -> list[dict[str, float]]:
    import torch

    from pdserve.kvtransfer.tensors import checksum
    from pdserve.kvtransfer.transport import make_sender

    child = subprocess.Popen([sys.executable, "-m", "pdserve.bench.cuda_ipc_check", "--receiver"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    rows = []
    try:
        address = child.stdout.readline().strip()
        if not address:
            raise RuntimeError("the receiving process did not start (see its stderr above)")
        with make_sender("cuda_ipc", lease_s=60.0) as sender:
            for mb in sizes:
                blocks = mb * 2**20 // BLOCK_BYTES
                shape = (LAYOUT.num_layers, 2, blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
                payload = torch.randn(shape, device="cuda").to(torch.bfloat16)
                trips, copies = [], []
                for i in range(repeats + 1):  # the first one opens the child's mapping: untimed
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    sender.send(address, _meta(payload, f"{mb}-{i}"), payload)
                    (ack,) = sender.poll_acks(timeout=60)
                    trip = time.perf_counter() - start
                    line = json.loads(child.stdout.readline())
                    if not ack.ok or "error" in line:
                        raise RuntimeError(f"transfer {mb} MiB refused: {ack.reason or line.get('error')}")
                    if i:
                        trips.append(trip)
                        copies.append(line["copy_s"])
                dst = torch.empty_like(payload)
                nbytes = mb * 2**20
                rows.append({
                    "mib": mb,
                    "ipc_round_trip_gb_s": nbytes / statistics.median(trips) / 1e9,
                    "ipc_round_trip_ms": statistics.median(trips) * 1e3,
                    "receiver_copy_in_gb_s": nbytes / statistics.median(copies) / 1e9,
                    "local_d2d_copy_gb_s": nbytes / _seconds(lambda d=dst, s=payload: d.copy_(s), repeats) / 1e9,
                    "wsum64_gb_s": nbytes / _seconds(lambda s=payload: checksum(s, "wsum64"), repeats) / 1e9,
                })
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.receiver:
        return receive()
    import torch

    if not torch.cuda.is_available():
        print("cuda_ipc_check needs a CUDA GPU; nothing to measure")
        return 0
    rows = measure(args.sizes, args.repeats)
    print(f"{torch.cuda.get_device_name()}: CUDA IPC between two processes, Llama-3-8B's KV layout "
          f"(2 MiB a block), median of {args.repeats}")
    print(f"{'MiB':>5} {'IPC round trip':>15} {'ms':>7} {'receiver copy-in':>17} {'local D2D copy':>15} {'wsum64':>8}")
    for r in rows:
        print(f"{r['mib']:>5} {r['ipc_round_trip_gb_s']:>11.1f} GB/s {r['ipc_round_trip_ms']:>7.2f} "
              f"{r['receiver_copy_in_gb_s']:>12.1f} GB/s {r['local_d2d_copy_gb_s']:>10.1f} GB/s "
              f"{r['wsum64_gb_s']:>8.1f}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
