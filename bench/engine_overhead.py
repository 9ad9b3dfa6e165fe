"""Engine overhead: decode step time and prefill throughput next to the model's bare matmuls.

    python -m pdserve.bench.engine_overhead [--threads 1] [--model default]

For each case the same run times (a) one engine step through the scheduler, runner, paged
attention and sampler, and (b) only the matmuls of the same model on the same number of tokens
(every projection of every layer plus the LM head rows that sample). The ratio a/b is the
engine's overhead: attention, norms, rotary, packing, sampling and Python.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.config.engine import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.model.llama import Linear
from pdserve.model.weights import load_model
from pdserve.protocol.sampling import SamplingParams


def bare_matmuls(engine: Engine, tokens: int, sampled_rows: int, repeats: int) -> float:
    """Median seconds of every weight matmul of the model for `tokens` tokens."""
    model = engine.runner.model
    # The model's own weight tensors, in the layout it uses ([in, out] contiguous, see Linear).
    weights = [m.weight.t() for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    x = {w.shape[0]: torch.randn(tokens, w.shape[0]) for w in weights}
    head = torch.randn(sampled_rows, model.lm_head.weight.shape[1])
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for w in weights:
            torch.matmul(x[w.shape[0]], w)
        torch.matmul(head, model.lm_head.weight.t())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def decode_step_time(engine: Engine, batch: int, context: int, repeats: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=repeats + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", [1 + (i * 7 + j) % 1000 for j in range(context)], params)
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.abort([f"d{batch}-{i}" for i in range(batch)])
    return statistics.median(times)


def prefill_time(engine: Engine, tokens: int, repeats: int) -> float:
    times = []
    for r in range(repeats):
        engine.add_request(f"p{tokens}-{r}", [1 + (r * 13 + j) % 5000 for j in range(tokens)],
                           SamplingParams(temperature=0.0, max_tokens=1))
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--context", type=int, default=256, help="tokens already in each decoding request")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    engine = Engine(EngineConfig(max_num_batched_tokens=1024, max_num_seqs=64, enable_prefix_caching=False), loaded=loaded)
    print(f"model {loaded.name}, {engine.config.dtype}, {args.threads} thread(s), median of {args.repeats}")
    print(f"{'case':<24}{'engine ms':>12}{'matmuls ms':>12}{'ratio':>8}{'tokens/s':>12}")
    for batch in (1, 8, 32):
        e = decode_step_time(engine, batch, args.context, args.repeats)
        m = bare_matmuls(engine, batch, batch, args.repeats)
        print(f"{f'decode batch {batch}':<24}{e * 1e3:>12.1f}{m * 1e3:>12.1f}{e / m:>8.2f}{batch / e:>12.1f}")
    for tokens in (64, 256, 1024):
        e = prefill_time(engine, tokens, args.repeats)
        m = bare_matmuls(engine, tokens, 1, args.repeats)
        print(f"{f'prefill {tokens} tokens':<24}{e * 1e3:>12.1f}{m * 1e3:>12.1f}{e / m:>8.2f}{tokens / e:>12.1f}")


if __name__ == "__main__":
    main()
