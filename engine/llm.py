"""Offline API: `LLM(model=...).generate(prompts, SamplingParams)` over one engine.

All requests go in at once and run together under the engine's batching policy; results come
back in input order. Prompts may be strings (raw completion), token id lists, or chat message
lists (rendered through the model's chat template).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from pdserve.config.engine import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.model.weights import LoadedModel
from pdserve.protocol.sampling import SamplingParams

Prompt = str | Sequence[int] | Sequence[dict[str, Any]]


@dataclass(slots=True)
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    arrival_time: float = 0.0
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival_time if self.token_times else float("nan")

    @property
    def tbts(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


class LLM:
    """One engine in this process. Keyword arguments are EngineConfig fields (policy=..., ...)."""

    def __init__(self, model: str = "default", *, loaded: LoadedModel | None = None,
                 config: EngineConfig | None = None, **engine_kwargs: Any) -> None:
        self.config = config or EngineConfig(model=model, **engine_kwargs)
        self.engine = Engine(self.config, loaded)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            messages: list[dict[str, Any]] = list(prompt)  # type: ignore[arg-type]
            return self.tokenizer.encode_chat(messages, add_generation_prompt=True)
        return [int(t) for t in prompt]  # type: ignore[arg-type]

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True, arrival_offsets: Sequence[float] | None = None) -> list[GenerationOutput]:
        """Run every prompt to completion. `arrival_offsets` (seconds from now) releases each
        prompt into the engine at that time, for offline arrival-rate experiments."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item,assignment]
        params = sampling_params or SamplingParams(temperature=0.0, max_tokens=64)
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        encoded = [self.encode_prompt(p) for p in prompts]  # type: ignore[arg-type]
        offsets = list(arrival_offsets) if arrival_offsets is not None else [0.0] * len(encoded)
        order = sorted(range(len(encoded)), key=lambda i: offsets[i])
        ids = [f"offline-{self._next_id + i}" for i in range(len(encoded))]
        self._next_id += len(encoded)
        results: dict[str, GenerationOutput] = {}
        t0 = time.time()
        pending = list(order)
        bar = tqdm(total=len(encoded), desc="generate", unit="req", disable=not use_tqdm)
        while pending or self.engine.has_unfinished():
            now = time.time()
            while pending and t0 + offsets[pending[0]] <= now:
                i = pending.pop(0)
                self.engine.add_request(ids[i], encoded[i], params_list[i], arrival_time=t0 + offsets[i])
                results[ids[i]] = GenerationOutput(ids[i], encoded[i], [], "", None, arrival_time=t0 + offsets[i])
            if not self.engine.has_unfinished():
                time.sleep(max(0.0, min(0.01, t0 + offsets[pending[0]] - time.time())))
                continue
            for out in self.engine.step():
                res = results[out.request_id]
                res.token_ids.extend(out.new_token_ids)
                res.token_times.extend([time.time()] * len(out.new_token_ids))
                res.num_cached_tokens = out.num_cached_tokens
                if out.logprobs:
                    res.logprobs.extend(out.logprobs)
                if out.finished:
                    res.finish_reason = out.finish_reason
                    bar.update(1)
        bar.close()
        outs = [results[ids[i]] for i in range(len(encoded))]
        for o in outs:
            o.text = self.tokenizer.decode(o.token_ids)
        return outs

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, **kw: Any) -> list[GenerationOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate(convs, sampling_params, **kw)  # type: ignore[arg-type]
