"""How long a new structured-output constraint stops the other streams of a worker: the longest
gap between two tokens of unconstrained streams while the constraint compiles.

    python -m pdserve.bench.grammar_stall [--model default] [--threads 1] [--streams 4]

Two ways, on the same engine: "on the loop" compiles the constraint on the engine loop's thread
and then queues the request (what `Engine.add_request` did before constraints compiled off the
loop); "off the loop" is `Engine.add_request` now, which queues the request while its matcher
compiles on the engine's compile thread. Each constraint is new to the engine's cache (its
property names are fresh), so both compile it whole.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch

import pdserve.text.grammar as grammar_module
from pdserve.config.engine import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.model.weights import load_model
from pdserve.protocol.sampling import SamplingParams, StructuredOutput
from pdserve.text.grammar import MAX_PROPERTIES, GrammarError, check_limits

_fresh = itertools.count()


def wide_object(n: int) -> dict:
    """The issue's repro for n=3000: one object of n optional properties (~30 KB)."""
    k = next(_fresh)
    return {"type": "object", "properties": {f"p{k}_{i}": {} for i in range(n)}}


def widest_accepted() -> dict:
    """About the largest schema the limits accept: objects at the property limit, up to 64 KiB."""
    k = next(_fresh)
    inner = {"type": "object", "properties": {f"q{k}_{i}": {} for i in range(MAX_PROPERTIES)}}
    return {"type": "object", "properties": {f"o{k}_{j}": inner for j in range(16)}}


def stall(engine: Engine, schema: dict, on_loop: bool, rid: str) -> tuple[float, float, float]:
    """(median gap before, longest gap while compiling, compile seconds) for the free streams."""
    spec = StructuredOutput("json_schema", json.dumps(schema, separators=(",", ":")))
    sp = SamplingParams(temperature=0.0, max_tokens=4, structured=spec)
    gaps, last = [], time.perf_counter()
    for _ in range(8):
        engine.step()
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    start = time.perf_counter()
    if on_loop:
        engine.grammars.compile(spec)  # the loop thread compiles; the request then finds it cached
    engine.add_request(rid, [1, 2, 3], sp)
    longest = 0.0
    while True:  # until the request is past compiling, and at least one step
        engine.step()
        now = time.perf_counter()
        longest = max(longest, now - last)
        last = now
        if rid not in engine.scheduler.compiling:
            break
    compiled = time.perf_counter() - start
    engine.abort([rid])
    return statistics.median(gaps), longest, compiled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--streams", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=args.model, device="cpu", dtype="float32", max_num_seqs=16),
                    load_model(args.model))
    free = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(f"free-{i}", [1 + i, 2, 3, 4], free)
    for _ in range(4):
        engine.step()
    engine.grammars.ll_tokenizer()  # built once per process, not part of a constraint's cost
    print(f"{args.streams} unconstrained streams decoding; gaps between their tokens, ms")
    print("| constraint | compiled | median gap | longest gap while it compiles | compile |")
    print("|---|---|---|---|---|")
    cases = [("3,000 optional properties (~30 KB)", lambda: wide_object(3000)),
             (f"16 objects x {MAX_PROPERTIES} optional properties (~50 KB)", widest_accepted)]
    for n, (name, make) in enumerate(cases):
        schema = make()
        try:
            check_limits(StructuredOutput("json_schema", json.dumps(schema, separators=(",", ":"))))
            note = ""
        except GrammarError as exc:
            note = f" (refused by the limits now: {exc})"
        for on_loop in (True, False):
            if note and not on_loop:
                continue
            # What the engine did before the limit existed: compile it anyway, on the loop.
            grammar_module.MAX_PROPERTIES = 10**6 if note else MAX_PROPERTIES
            median, longest, compiled = stall(engine, make(), on_loop, f"c{n}-{on_loop}")
            grammar_module.MAX_PROPERTIES = MAX_PROPERTIES
            where = "on the loop" if on_loop else "off the loop"
            print(f"| {name}{note} | {where} | {median * 1e3:.1f} | {longest * 1e3:.0f} | {compiled * 1e3:.0f} |")


if __name__ == "__main__":
    main()
