"""Turns one step's logits into next tokens, per request's SamplingParams.

Order per row: penalties -> min_tokens masking -> the grammar's mask (structured outputs) ->
(greedy argmax | temperature, top-k, top-p, min-p, then a draw). Only constrained rows pay for a
mask; a row the grammar leaves no token for is reported in `errors`, not sampled. A seeded request's draw for output position k comes from a generator
seeded by (seed, k) alone: the same seed gives the same output whatever else is in the batch,
and whichever worker samples position k (the prefill worker samples position 0, the decode
worker the rest) draws exactly what one engine would have. Logprobs are reported from the model's distribution
after penalties, before temperature and truncation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.engine.request import Request
from pdserve.text.grammar import GrammarError


def position_generator(seed: int, position: int) -> torch.Generator:
    """The generator of a seeded request's draw at output `position` (a splitmix64 of both)."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return torch.Generator().manual_seed((z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF)


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # of each sampled token (None when no row asked)
    top_logprobs: list[tuple[tuple[int, float], ...]] | None
    # Rows that could not be sampled (row -> why): their grammar allows no token. Their entry
    # in token_ids is meaningless; the engine fails those requests.
    errors: dict[int, str] = field(default_factory=dict)


def edits_logits(req: Request) -> bool:
    """Whether sampling `req` changes or reads its row beyond the argmax: a penalty, a stop
    token masked for min_tokens, a grammar, logprobs, or a draw."""
    p = req.sampling
    return (not p.greedy or p.logprobs is not None or req.grammar is not None or p.repetition_penalty != 1.0
            or bool((p.frequency_penalty or p.presence_penalty) and req.num_output_tokens)
            or req.num_output_tokens < p.min_tokens)


class Sampler:
    def __init__(self, seed: int = 0, ops: object | None = None) -> None:
        """`ops`: torch.ops.pdserve_cpu, whose argmax_rows takes the greedy rows on the CPU."""
        self.generator = torch.Generator().manual_seed(seed)
        self.ops = ops

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """max(dim=-1).indices (not argmax: 2.5x faster on the CPU), the same first maximum and
        first NaN through the compiled kernel where there is one (torch's takes 3-10 ms over
        32 x 49,152 logits on 2 cores)."""
        if self.ops is not None and logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16):
            return self.ops.argmax_rows(logits if logits.stride(-1) == 1 else logits.contiguous())  # type: ignore[attr-defined]
        return logits.max(dim=-1).indices

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        """logits: [B, V] in the model's dtype, row i belongs to requests[i]."""
        if not any(edits_logits(r) for r in requests):
            # Every row plain greedy: the argmax of the model's own logits where they are, and on
            # an accelerator only the token ids cross to the host, not the [B, V] logits.
            return SampleResult(self._argmax(logits).tolist(), None, None)
        # A float32 host copy to edit; its greedy rows take the same argmax (widening keeps every
        # value, so the index is the same).
        logits = logits.float().cpu()
        self._apply_penalties(logits, requests)
        self._mask_early_stop(logits, requests)
        want_lp = any(r.sampling.logprobs is not None for r in requests)
        logprobs = torch.log_softmax(logits, dim=-1) if want_lp else None
        errors = self._mask_grammar(logits, requests)

        greedy = [i for i, r in enumerate(requests) if r.sampling.greedy]
        # No row gather when every row is greedy.
        if len(greedy) == len(requests):
            tokens = self._argmax(logits)
        else:
            tokens = torch.empty(len(requests), dtype=torch.long)
            if greedy:
                idx = torch.tensor(greedy)
                tokens[idx] = self._argmax(logits[idx])
        for i, req in enumerate(requests):
            if not req.sampling.greedy and i not in errors:
                tokens[i] = self._draw(logits[i], req)

        token_list = tokens.tolist()
        if logprobs is None:
            return SampleResult(token_list, None, None, errors)
        chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        tops: list[tuple[tuple[int, float], ...]] = []
        for i, req in enumerate(requests):
            k = req.sampling.logprobs or 0
            if k:
                vals, ids = logprobs[i].topk(k)
                tops.append(tuple(zip(ids.tolist(), vals.tolist(), strict=True)))
            else:
                tops.append(())
        return SampleResult(token_list, chosen, tops, errors)

    def _draw(self, row: torch.Tensor, req: Request) -> int:
        p = req.sampling
        row = row / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            cum = sorted_p.cumsum(0)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = (cum - sorted_p) >= p.top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        # Exponential race: argmax(p / E) with E ~ Exp(1) is an exact draw from p.
        gen = self.generator if p.seed is None else position_generator(p.seed, req.num_output_tokens)
        noise = torch.empty_like(probs).exponential_(generator=gen)
        return int((probs / noise).argmax())

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
        for i, req in enumerate(requests):
            p = req.sampling
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(req.token_ids)), dtype=torch.long)
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.frequency_penalty or p.presence_penalty) and req.num_output_tokens:
                out = torch.tensor(req.output_token_ids, dtype=torch.long)
                counts = torch.zeros(logits.shape[1]).scatter_add_(0, out, torch.ones(len(out)))
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()

    @staticmethod
    def _mask_grammar(logits: torch.Tensor, requests: list[Request]) -> dict[int, str]:
        """-inf where a constrained row's grammar forbids the token; returns the rows left with
        none (or whose grammar failed). Unconstrained rows are not touched."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return {}
        errors: dict[int, str] = {}
        vocab = logits.shape[1]
        for i in rows:
            grammar = requests[i].grammar
            assert grammar is not None
            try:
                words = grammar.allowed_bitmask()
            except GrammarError as exc:
                errors[i] = f"structured output failed: {exc}"
                continue
            if grammar.error is not None:
                errors[i] = f"structured output failed: {grammar.error}"
                continue
            bits = np.unpackbits(np.frombuffer(words, dtype=np.uint8), bitorder="little")
            forbidden = np.ones(vocab, dtype=np.bool_)  # ids past the grammar's vocabulary too
            n = min(vocab, bits.size)
            forbidden[:n] = bits[:n] == 0
            row = logits[i]  # a view: masked in place
            row.masked_fill_(torch.from_numpy(forbidden), float("-inf"))
            if float(row.max()) == float("-inf"):
                errors[i] = ("structured output failed: no token can continue the grammar after "
                             f"{requests[i].num_output_tokens} output tokens")
        return errors

    @staticmethod
    def _mask_early_stop(logits: torch.Tensor, requests: list[Request]) -> None:
        for i, req in enumerate(requests):
            p = req.sampling
            if req.num_output_tokens < p.min_tokens:
                stops = set(p.stop_token_ids) | set(req.eos_token_ids)
                if stops:
                    logits[i, list(stops)] = float("-inf")
