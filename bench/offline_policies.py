"""Offline comparison of the colocated batching policies on one mixed workload, in one process.

    python -m pdserve.bench.offline_policies [--rate 1.0] [--num-requests 24] [--policies static,chunked] [--json out.json]

The workload is short prompts with a long one every `--long-every`-th request, released into the
engine in real time at a fixed rate (`LLM.generate(..., arrival_offsets=...)`). Every policy runs
the identical workload on a fresh engine over the same loaded weights, one after the other, with
the KV cache sized so that nothing is pre-empted. Per policy it reports throughput (requests/s and
output tokens/s over the span from the first arrival to the last token), TTFT (first token minus
arrival) and TBT (every gap between two consecutive tokens of one request) at p50 and p99.

What to expect: prefill-first stalls every running decode while a long prompt prefills (high TBT
p99); mixed joins the long prompt to a decode step, which stalls too; chunked caps a step at
`--max-num-batched-tokens`, which bounds TBT; static lets no request join a running batch (worst
TTFT and throughput). Prompts are random token ids of exact lengths (no shared prefixes, so the
prefix cache plays no part). Every option `--foo-bar` defaults to PDSERVE_FOO_BAR when set.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from pdserve.config.envs import flag_default
from pdserve.config.names import COLOCATED_POLICIES

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Workload:
    """Request i is long when (i + 1) % long_every == 0 and arrives at i / rate seconds."""

    num_requests: int = 24
    # Defaults sized for SmolLM2 on one CPU thread: near, not past, saturation, so that the
    # policies differ in latency and static (which cannot refill its batch) falls behind.
    rate: float = 1.0
    long_every: int = 6
    short_len: int = 64
    long_len: int = 512
    output_len: int = 24
    seed: int = 0

    def build(self, vocab_size: int) -> tuple[list[list[int]], list[float]]:
        """(prompts as token ids, arrival offsets in seconds); the same for the same fields."""
        rng = np.random.default_rng(self.seed)
        # Skip the low ids, where special tokens live, so that no prompt contains an EOS.
        lo = min(1000, vocab_size // 2)
        prompts = [
            rng.integers(lo, vocab_size, size=self.prompt_len(i)).tolist()
            for i in range(self.num_requests)
        ]
        return prompts, [i / self.rate for i in range(self.num_requests)]

    def prompt_len(self, i: int) -> int:
        long = self.long_every > 0 and (i + 1) % self.long_every == 0
        return self.long_len if long else self.short_len


@dataclass(slots=True)
class PolicyResult:
    policy: str
    duration_s: float
    request_throughput: float  # requests/s
    output_throughput: float  # output tokens/s
    p50_ttft_ms: float
    p99_ttft_ms: float
    p50_tbt_ms: float
    p99_tbt_ms: float
    max_tbt_ms: float
    steps: int
    steps_with_prefill: int
    preemptions: int
    tokens_digest: str  # of every request's greedy tokens: equal across policies when all is well


def percentile_ms(values: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, p)) if values else float("nan")


def run_policy(
    loaded, policy: str, work: Workload, max_num_batched_tokens: int, block_size: int
) -> PolicyResult:
    """One measured pass of the workload under `policy` on a fresh engine."""
    from pdserve.engine.llm import LLM
    from pdserve.protocol.sampling import SamplingParams

    prompts, offsets = work.build(loaded.config.vocab_size)
    longest = max(len(p) for p in prompts) + work.output_len
    blocks_per_request = [-(-(len(p) + work.output_len) // block_size) for p in prompts]
    llm = LLM(
        loaded=loaded,
        policy=policy,
        max_model_len=longest + block_size,
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        num_kv_blocks=sum(blocks_per_request) + 8,
        max_num_seqs=max(64, work.num_requests),
    )
    params = SamplingParams(temperature=0.0, max_tokens=work.output_len, ignore_eos=True)
    # Warm up: the first steps of a fresh engine pay one-off allocation costs. The warm-up
    # prompt shares no block with the workload's, so it gives the measured run no cache hit.
    llm.generate(
        [list(range(1000, 1000 + work.short_len))],
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
        use_tqdm=False,
    )
    c = llm.engine.counters
    steps0, prefill_steps0, preempt0 = c.steps, c.steps_with_prefill, c.preemptions
    outs = llm.generate(prompts, params, use_tqdm=False, arrival_offsets=offsets)
    start = min(o.arrival_time for o in outs)
    duration = max(o.token_times[-1] for o in outs) - start
    ttfts = [o.ttft for o in outs]
    tbts = [gap for o in outs for gap in o.tbts]
    n_out = sum(len(o.token_ids) for o in outs)
    digest = hashlib.sha256(json.dumps([o.token_ids for o in outs]).encode()).hexdigest()[:16]
    result = PolicyResult(
        policy=policy,
        duration_s=duration,
        request_throughput=len(outs) / duration,
        output_throughput=n_out / duration,
        p50_ttft_ms=percentile_ms(ttfts, 50),
        p99_ttft_ms=percentile_ms(ttfts, 99),
        p50_tbt_ms=percentile_ms(tbts, 50),
        p99_tbt_ms=percentile_ms(tbts, 99),
        max_tbt_ms=max(tbts) * 1e3 if tbts else float("nan"),
        steps=c.steps - steps0,
        steps_with_prefill=c.steps_with_prefill - prefill_steps0,
        preemptions=c.preemptions - preempt0,
        tokens_digest=digest,
    )
    del llm
    gc.collect()
    return result


COLUMNS = [
    ("policy", "policy"),
    ("req/s", "request_throughput"),
    ("out tok/s", "output_throughput"),
    ("TTFT p50 ms", "p50_ttft_ms"),
    ("TTFT p99 ms", "p99_ttft_ms"),
    ("TBT p50 ms", "p50_tbt_ms"),
    ("TBT p99 ms", "p99_tbt_ms"),
    ("TBT max ms", "max_tbt_ms"),
    ("steps", "steps"),
    ("prefill steps", "steps_with_prefill"),
]


def format_results(results: list[PolicyResult]) -> str:
    from pdserve.bench.report import format_table

    return format_table(
        [h for h, _ in COLUMNS], [[getattr(r, f) for _, f in COLUMNS] for r in results]
    )


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names or any(p not in COLOCATED_POLICIES for p in names):
        raise argparse.ArgumentTypeError(
            f"policies must be a comma-separated subset of {','.join(COLOCATED_POLICIES)}; got {text!r}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    d = Workload()
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.offline_policies",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=flag_default("model", "default"),
        help="'default' (SmolLM2-135M), a .gguf or a HF directory",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=flag_default("rate", d.rate),
        help="arrivals per second (fixed spacing)",
    )
    p.add_argument("--num-requests", type=int, default=flag_default("num-requests", d.num_requests))
    p.add_argument(
        "--long-every",
        type=int,
        default=flag_default("long-every", d.long_every),
        help="every N-th request has a long prompt (0: none)",
    )
    p.add_argument(
        "--short-len",
        type=int,
        default=flag_default("short-len", d.short_len),
        help="short prompt tokens",
    )
    p.add_argument(
        "--long-len",
        type=int,
        default=flag_default("long-len", d.long_len),
        help="long prompt tokens",
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=flag_default("output-len", d.output_len),
        help="output tokens per request",
    )
    p.add_argument(
        "--policies",
        type=_policies,
        default=_policies(flag_default("policies", ",".join(COLOCATED_POLICIES))),
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=flag_default("max-num-batched-tokens", 128),
        help="step token budget of the chunked policy (the others take whole prompts)",
    )
    p.add_argument("--block-size", type=int, default=flag_default("block-size", 16))
    # One thread by default: with two OpenMP threads on a 2-core machine that anything else
    # shares, a step can take many times longer (spinning threads wait on a descheduled peer).
    p.add_argument(
        "--threads",
        type=int,
        default=flag_default("threads", 1),
        help="torch CPU threads (0: torch's default)",
    )
    p.add_argument("--seed", type=int, default=flag_default("seed", d.seed))
    p.add_argument(
        "--json",
        default=flag_default("json", None),
        metavar="PATH",
        help="also write the results here",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for name in (
        "rate",
        "num_requests",
        "short_len",
        "long_len",
        "output_len",
        "max_num_batched_tokens",
        "block_size",
    ):
        if getattr(args, name) <= 0:
            raise SystemExit(
                f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}"
            )
    if args.long_every < 0:
        raise SystemExit(
            f"--long-every must be 0 (no long prompts) or positive, got {args.long_every}"
        )
    import torch

    from pdserve.model.weights import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    work = Workload(
        num_requests=args.num_requests,
        rate=args.rate,
        long_every=args.long_every,
        short_len=args.short_len,
        long_len=args.long_len,
        output_len=args.output_len,
        seed=args.seed,
    )
    loaded = load_model(args.model)
    results = []
    for policy in args.policies:
        t = time.time()
        results.append(
            run_policy(loaded, policy, work, args.max_num_batched_tokens, args.block_size)
        )
        print(f"{policy}: done in {time.time() - t:.1f}s", file=sys.stderr, flush=True)
    print(
        f"model={loaded.name} threads={torch.get_num_threads()} {work}  chunked budget={args.max_num_batched_tokens}"
    )
    print(format_results(results))
    if len({r.tokens_digest for r in results}) > 1:
        log.warning(
            "greedy tokens differ between policies: %s",
            {r.policy: r.tokens_digest for r in results},
        )
    if args.json:
        from pdserve.bench.report import write_json

        write_json(
            args.json,
            {
                "model": loaded.name,
                "threads": torch.get_num_threads(),
                "workload": asdict(work),
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "block_size": args.block_size,
                "results": [asdict(r) for r in results],
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
