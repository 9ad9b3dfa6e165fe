"""Attention kernel speed: achieved memory bandwidth as a fraction of the device's own peak.

    python -m pdserve.bench.kernel_bench [--batch 8] [--context-len 4096] [--prefill-len 2048] ...
    python -m pdserve.bench.kernel_bench --interpret     # tiny shapes through Triton's interpreter (CPU)

The peak is a device-to-device copy measured in the same run (read + write bytes / time). For
each operation the Triton kernel and the PyTorch reference are timed on the same inputs; bytes
are the minimum each must move (every K/V byte read once, q and out once). Prefill is compute
bound, so its TFLOP/s is shown too. Without CUDA (and without --interpret) it says so and exits 0.
Every option `--foo-bar` defaults to $PDSERVE_FOO_BAR when set.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from pdserve.config import envs
from pdserve.config.envs import flag_default

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.kernel_bench", description=(__doc__ or "").split("\n")[0]
    )

    def opt(name: str, default: str, kind: type, text: str) -> None:
        p.add_argument(f"--{name}", type=kind, default=kind(flag_default(name, default)),
                       help=f"{text} (default: {default}; env PDSERVE_{name.upper().replace('-', '_')})")  # fmt: skip

    opt("batch", "8", int, "decode batch size")
    opt("context-len", "4096", int, "tokens already in each decode sequence's cache")
    opt("prefill-len", "2048", int, "new tokens of the prefill sequence")
    opt("prefill-prefix", "0", int, "cached prefix tokens of the prefill sequence")
    opt("num-heads", "32", int, "query heads")
    opt("num-kv-heads", "8", int, "KV heads")
    opt("head-dim", "128", int, "head size")
    opt("block-size", "16", int, "KV cache page size")
    opt("dtype", "bfloat16", str, "float32, bfloat16 or float16")
    opt("repeats", "20", int, "timed runs per measurement (median)")
    p.add_argument("--interpret", action="store_true",
                   default=flag_default("interpret", False),
                   help="run tiny shapes on the CPU through Triton's interpreter (env PDSERVE_INTERPRET)")  # fmt: skip
    args = p.parse_args(argv)
    if args.dtype not in DTYPES:
        p.error(f"--dtype must be one of {sorted(DTYPES)}, got {args.dtype!r}")
    return args


def time_fn(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median seconds of `fn` after one warm-up call (compilation, allocator)."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def copy_peak_bytes_per_s(device: torch.device, repeats: int, nbytes: int) -> float:
    """Read + write bytes per second of a plain device-to-device copy: the practical peak."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), repeats, device)
    return 2 * nbytes / seconds


def run(args: argparse.Namespace) -> int:
    if args.interpret:
        # Triton reads this when its kernels are decorated, i.e. at first import, below.
        envs.set_in_this_process("TRITON_INTERPRET", "1")
        device = torch.device("cpu")
        args.batch, args.context_len, args.prefill_len = 2, 64, 48
        args.num_heads, args.num_kv_heads, args.head_dim = 4, 2, 64
        args.repeats = min(args.repeats, 2)
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print(
            "kernel_bench needs a CUDA GPU (or --interpret for a tiny CPU run); nothing to measure"
        )
        return 0

    from pdserve.kernels.reference import ReferenceBackend
    from pdserve.kernels.testing import make_case
    from pdserve.kernels.triton_backend import TritonBackend

    dtype = DTYPES[args.dtype]
    group = args.num_heads // args.num_kv_heads
    elt = torch.empty((), dtype=dtype).element_size()
    shape: dict[str, Any] = dict(num_kv_heads=args.num_kv_heads, group=group, head_dim=args.head_dim,
                 block_size=args.block_size, dtype=dtype, device=device)  # fmt: skip
    kv_row = args.num_kv_heads * args.head_dim * elt  # bytes of one token's K (or V)
    q_row = args.num_heads * args.head_dim * elt

    decode_case = make_case([1] * args.batch, [args.context_len] * args.batch, **shape)
    prefill_case = make_case([args.prefill_len], [args.prefill_prefix], **shape, seed=1)
    ctx = args.context_len + 1
    prefill_ctx = args.prefill_prefix + args.prefill_len
    flops = (
        4
        * args.num_heads
        * args.head_dim
        * args.prefill_len
        * (args.prefill_prefix + (args.prefill_len + 1) / 2)
    )

    def ops(backend):
        d, p = decode_case, prefill_case
        k_cache, v_cache = p.k_cache.clone(), p.v_cache.clone()
        return {
            "store_kv": (lambda: backend.store_kv(p.key, p.value, k_cache, v_cache, p.slot_mapping),
                         4 * args.prefill_len * kv_row),
            "decode": (lambda: backend.decode_attention(d.q, d.k_cache, d.v_cache, d.seq_lens, d.block_tables, d.scale),
                       2 * args.batch * ctx * kv_row + 2 * args.batch * q_row),
            "prefill": (lambda: backend.prefill_attention(p.q, p.key, p.value, p.k_cache, p.v_cache,
                                                          p.cu_seqlens_q, p.seq_lens, p.block_tables, p.scale),
                        2 * prefill_ctx * kv_row + 2 * args.prefill_len * q_row),
        }  # fmt: skip

    peak = copy_peak_bytes_per_s(device, args.repeats, 1 << (30 if device.type == "cuda" else 24))
    name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    )
    print(f"{name}: copy peak {peak / 1e9:.0f} GB/s; dtype {args.dtype}, Hq {args.num_heads}, "
          f"Hkv {args.num_kv_heads}, D {args.head_dim}, page {args.block_size}")  # fmt: skip
    print(f"decode: batch {args.batch} x {ctx} tokens; prefill: {args.prefill_len} new over "
          f"{args.prefill_prefix} cached")  # fmt: skip
    if args.interpret:
        print("interpreter timings say nothing about GPU speed; this run checks the plumbing")
    print(f"{'op':10} {'backend':10} {'time us':>10} {'GB/s':>8} {'of peak':>8} {'TFLOP/s':>8}")
    results: dict[tuple[str, str], torch.Tensor] = {}
    for backend in (TritonBackend(), ReferenceBackend()):
        for op, (fn, nbytes) in ops(backend).items():
            seconds = time_fn(fn, args.repeats, device)
            if op != "store_kv":
                results[(op, backend.name)] = fn()
            rate = nbytes / seconds
            tflops = f"{flops / seconds / 1e12:8.1f}" if op == "prefill" else f"{'':8}"
            print(
                f"{op:10} {backend.name:10} {seconds * 1e6:10.1f} {rate / 1e9:8.1f} {rate / peak:8.1%} {tflops}"
            )
    for op in ("decode", "prefill"):
        diff = (
            (results[(op, "triton")].float() - results[(op, "reference")].float())
            .abs()
            .max()
            .item()
        )
        print(f"{op}: max |triton - reference| = {diff:.2e}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
