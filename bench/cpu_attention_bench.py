"""Decode attention on the CPU from DRAM: a whole decode step's attention (every layer) over a
KV cache laid out as the engine's, on 4 KiB pages and on transparent huge pages, side by side.

    python -m pdserve.bench.cpu_attention_bench [--batch 32] [--context 256] [--spread 1 3] ...

`--spread s` puts a sequence's consecutive blocks s blocks apart (1: side by side, as in a fresh
engine; 3: as a long-running server's free list leaves them). Each run first reads a buffer
larger than the caches, so the KV bytes come from DRAM. The two layouts alternate, round after
round, so both see the same noise; the table gives the median and the best round, and the
cache's bytes over the median as GB/s. The shapes default to SmolLM2-135M's (30 layers, 9 query
heads, 3 KV heads, head size 64) in bfloat16.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from pdserve.kernels import cpu_ops
from pdserve.kernels.huge_pages import zeros_on_huge_pages


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--spread", type=int, nargs="+", default=[1, 3])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--query-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks", type=int, default=4096, help="blocks in the cache (the engine sizes it by memory)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    ops: Any = cpu_ops.load()  # torch.ops.pdserve_cpu
    if ops is None:
        raise SystemExit("the compiled CPU kernels did not build here (see the log above)")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shape = (args.layers, 2, args.blocks, args.block_size, args.kv_heads, args.head_size)
    caches = {"4 KiB pages": torch.zeros(shape, dtype=dtype), "huge pages": zeros_on_huge_pages(shape, dtype)}
    for kv in caches.values():
        kv.normal_()
    per_seq = -(-args.context // args.block_size)
    lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    q = torch.randn(args.batch, args.query_heads, args.head_size, dtype=dtype)
    flush = torch.ones(2**27)  # 512 MB
    kv_bytes = args.batch * args.context * args.layers * 2 * args.kv_heads * args.head_size * q.element_size()
    print(f"decode attention, {args.layers} layers, batch {args.batch}, context {args.context}, {args.dtype}, "
          f"{args.threads} thread(s): {kv_bytes / 1e6:.0f} MB of KV a step")
    print(f"{'spread':>7}{'pages':>13}{'median ms':>11}{'best ms':>9}{'GB/s':>7}")
    for spread in args.spread:
        if args.batch * per_seq * spread > args.blocks:
            raise SystemExit(f"--spread {spread}: {args.batch * per_seq * spread} blocks needed, --blocks {args.blocks}")
        tables = (torch.arange(args.batch * per_seq, dtype=torch.int32) * spread).view(args.batch, per_seq)
        times: dict[str, list[float]] = {name: [] for name in caches}
        for _ in range(args.rounds + 1):  # the first round warms up
            for name, kv in caches.items():
                flush.sum()
                t = time.perf_counter()
                for layer in range(args.layers):
                    ops.decode_attention(q, kv[layer, 0], kv[layer, 1], lens, tables, args.head_size**-0.5)
                times[name].append(time.perf_counter() - t)
        for name, ts in times.items():
            med = statistics.median(ts[1:])
            print(f"{spread:>7}{name:>13}{med * 1e3:>11.2f}{min(ts[1:]) * 1e3:>9.2f}{kv_bytes / med / 1e9:>7.1f}")


if __name__ == "__main__":
    main()
