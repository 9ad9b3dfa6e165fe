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


class StepRecorder:
    """Stands in for torch.ops.pdserve_cpu in a model's CompiledLayers: records each step's
    (rows, decode rows) and runs the real decoder_layers_."""

    def __init__(self, ops) -> None:
        self.ops, self.steps = ops, []
        names = [a.name for a in ops.decoder_layers_.default._schema.arguments]
        self.num_decode_at = names.index("num_decode")

    def decoder_layers_(self, *args):
        self.steps.append((args[0].shape[0], args[self.num_decode_at]))
        return self.ops.decoder_layers_(*args)
