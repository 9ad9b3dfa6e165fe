"""What a structured-output constraint costs a decode step: batch 16 with 0, 1 and 16 rows
under a JSON-schema grammar. Two numbers per case: the whole engine step (noisy on a shared
machine) and the sampler alone on the same batch (where the masks are computed and applied).

    python -m pdserve.bench.structured_step [--model default] [--threads 1] [--repeats 30]

Every request decodes for the whole measurement: the constrained ones write one long JSON string
(a `minLength` keeps the grammar open), the others ignore EOS. Only constrained rows compute a
mask, so the first two lines should differ by about one row's mask time.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pdserve.config.engine import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.model.weights import load_model
from pdserve.protocol.sampling import SamplingParams, StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 40}, "story": {"type": "string", "minLength": 20000}},
    "required": ["title", "story"],
    "additionalProperties": False,
}


def step_times(engine: Engine, batch: int, constrained: int, context: int,
               repeats: int) -> tuple[list[float], list[float]]:
    """(engine step seconds, sampler seconds) over `repeats` decode steps of the batch."""
    free = SamplingParams(temperature=0.0, max_tokens=repeats + 8, ignore_eos=True)
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    ids = [f"b{constrained}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        params = SamplingParams(temperature=0.0, max_tokens=repeats + 8, structured=spec) if i < constrained else free
        engine.add_request(rid, [1 + (i * 7 + j) % 1000 for j in range(context)], params)
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t)
        assert not any(o.finished for o in outs), "a request ended during the measurement"
    # The sampler alone on this batch: it computes the masks but consumes nothing, so the
    # grammar states stay where the steps left them.
    rows = list(engine.scheduler.running)
    logits = torch.randn(len(rows), engine.model_config.vocab_size)
    sampling = []
    for _ in range(repeats * 5):
        t = time.perf_counter()
        engine.runner.sampler(logits.clone(), rows)
        sampling.append(time.perf_counter() - t)
    engine.abort(ids)
    return times, sampling


def ms(times: list[float], q: float = 0.5) -> float:
    times = sorted(times)
    return times[int(q * (len(times) - 1))] * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=128, help="prompt tokens of each request")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    engine = Engine(EngineConfig(max_num_batched_tokens=4096, max_num_seqs=64, enable_prefix_caching=False),
                    loaded=loaded)
    step_times(engine, args.batch, 1, args.context, 3)  # warm up (and build llguidance's vocabulary)
    print(f"model {loaded.name}, {engine.config.device}, {args.threads} thread(s), batch {args.batch}, "
          f"median of {args.repeats} decode steps")
    print(f"{'constrained rows':<18}{'step ms':>10}{'step p90':>10}{'sampler ms':>12}{'sampler +ms':>13}")
    base = None
    for constrained in (0, 1, args.batch):
        steps, sampler = step_times(engine, args.batch, constrained, args.context, args.repeats)
        base = ms(sampler) if base is None else base
        print(f"{constrained:<18}{ms(steps):>10.2f}{ms(steps, 0.9):>10.2f}{ms(sampler):>12.3f}"
              f"{ms(sampler) - base:>+13.3f}")


if __name__ == "__main__":
    main()
