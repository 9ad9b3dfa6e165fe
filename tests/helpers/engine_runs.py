"""Running an in-process Engine to completion in tests."""

from __future__ import annotations

from pdserve.engine.engine import Engine
from pdserve.protocol.sampling import SamplingParams


def greedy_tokens(engine: Engine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    """Add every prompt (greedy, exactly `max_tokens` each) and step until nothing runs or waits;
    returns each request's tokens."""
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.scheduler.running or engine.scheduler.waiting:
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return out
