"""Benchmark workloads: seeded, offline lists of requests (prompt, lengths, intended arrival time).

A workload is decided entirely before the run, from a seed, so two deployments (or two request
rates of a sweep) see the same prompts. Lengths and arrivals come from separate random streams:
changing the rate re-draws the arrival times and keeps every prompt.

Prompts are random common words. Without a tokenizer one word counts as one token, which is
close for BPE vocabularies (common short words with a leading space are single tokens); with
`tokenizer.json` the prompt is trimmed so its own token count (no chat template) is exact.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import msgspec
import numpy as np

_WORDS = ["the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are", "as", "with", "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by", "word", "but", "not", "what", "all", "were", "we", "when", "your", "can", "said", "there", "use", "an", "each", "which", "she", "do", "how", "their", "if", "will", "up", "other", "about", "out", "many", "then", "them", "these", "so", "some", "her", "would", "make", "like", "him", "into", "time", "has", "look", "two", "more", "write", "go", "see", "number", "no", "way", "could", "people", "my", "than", "first", "water", "been", "call", "who", "oil", "its", "now", "find", "long", "down", "day", "did", "get", "come", "made", "may", "part", "over", "new", "sound", "take", "only", "little", "work", "know", "place", "year", "live", "me", "back", "give", "most", "very", "after", "thing", "our", "just", "name", "good", "man", "think", "say", "great", "where", "help", "through", "much", "before", "line", "right", "too", "mean", "old", "any", "same", "tell", "boy", "follow", "came", "want", "show", "also", "around", "form", "three", "small", "set", "put", "end", "does", "another", "well", "large", "must", "big", "even", "such", "because", "turn", "here", "why", "ask", "went", "men", "read", "need", "land", "different", "home", "us", "move", "try", "kind", "hand", "picture", "again", "change", "off", "play", "spell", "air", "away", "animal", "house", "point", "page", "letter", "mother"]


class Arrival(str, Enum):
    """Inter-arrival distribution of an open-loop schedule."""

    POISSON = "poisson"
    GAMMA = "gamma"  # shape = burstiness: < 1 burstier than Poisson, > 1 more regular
    CONSTANT = "constant"


class WorkloadKind(str, Enum):
    RANDOM = "random"
    CONVERSATION = "conversation"
    CODE = "code"
    SHARED_PREFIX = "shared-prefix"
    INTERFERENCE = "interference"


class RequestSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One request of a workload; `arrival_s` is its intended send time from the run's start."""

    request_id: str
    prompt: str
    prompt_tokens: int
    max_tokens: int
    arrival_s: float = 0.0
    tag: str = "default"


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Everything that decides a workload; equal configs give identical workloads."""

    kind: WorkloadKind = WorkloadKind.RANDOM
    num_requests: int = 100
    seed: int = 0
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.5  # random: lengths uniform in mean * [1 - r, 1 + r]
    request_rate: float = math.inf  # requests/s of the open-loop stream; inf: all at t=0
    arrival: Arrival = Arrival.POISSON
    burstiness: float = 1.0
    prefix_len: int = 128  # shared-prefix: tokens shared within a group
    num_prefixes: int = 4
    long_input_len: int = 2048  # interference: the long prompts
    long_output_len: int = 16
    long_interval_s: float = 2.0
    tokenizer: str | None = None  # path to a tokenizer.json for exact prompt lengths


class PromptMaker:
    """Makes prompts of random words with a requested token count (exact with a tokenizer)."""

    def __init__(self, tokenizer_path: str | None = None) -> None:
        self._tok = None
        if tokenizer_path:
            from tokenizers import Tokenizer

            path = Path(tokenizer_path)
            if not path.is_file():
                raise FileNotFoundError(f"--tokenizer {path}: no such file (expected a tokenizer.json)")
            self._tok = Tokenizer.from_file(str(path))

    def count(self, text: str) -> int:
        if self._tok is None:
            return len(text.split())
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def make(self, num_tokens: int, rng: np.random.Generator, prefix: str = "") -> tuple[str, int]:
        """Return (text, token count) for `num_tokens` tokens, `prefix` included in the count."""
        have = self.count(prefix) if prefix else 0
        need = max(num_tokens - have, 0)

        def words(k: int) -> str:
            return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=k))

        if self._tok is None:
            return " ".join(x for x in (prefix, words(need)) if x), have + need
        body = words(need + 8)
        while len(self._tok.encode(body, add_special_tokens=False).ids) < need + 8:
            body += " " + words(need + 8)
        ids = self._tok.encode(body, add_special_tokens=False).ids
        # Token boundaries move when text is cut and re-joined: adjust the cut until the prompt,
        # prefix included, encodes to exactly num_tokens.
        cut, text = need, ""
        for _ in range(16):
            text = " ".join(x for x in (prefix, self._tok.decode(ids[:cut])) if x)
            got = self.count(text)
            if got == num_tokens or cut <= 0:
                break
            cut = min(max(cut + num_tokens - got, 0), len(ids))
        return text, self.count(text)


def arrival_offsets(
    n: int, rate: float, arrival: Arrival, burstiness: float, rng: np.random.Generator
) -> list[float]:
    """Intended send times (s from start) of `n` requests at `rate` requests/s."""
    if n <= 0:
        return []
    if not math.isfinite(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be positive (or inf), got {rate}")
    if arrival is Arrival.CONSTANT:
        gaps = np.full(n, 1.0 / rate)
    else:
        shape = 1.0 if arrival is Arrival.POISSON else burstiness
        if shape <= 0:
            raise ValueError(f"burstiness must be positive, got {burstiness}")
        # Gamma(shape, 1/(rate*shape)) has mean 1/rate whatever the shape.
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    gaps[0] = 0.0  # the first request goes at t=0
    return np.cumsum(gaps).tolist()


def _uniform_lens(rng: np.random.Generator, mean: int, ratio: float, n: int) -> np.ndarray:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n)


def _long_tail_lens(rng: np.random.Generator, median: int, sigma: float, n: int) -> np.ndarray:
    # Lognormal: most requests near the median, a few many times longer (chat and code traces).
    lens = rng.lognormal(math.log(max(median, 1)), sigma, size=n)
    return np.clip(np.rint(lens), 1, 16 * max(median, 1)).astype(int)


def build_workload(cfg: WorkloadConfig) -> list[RequestSpec]:
    """Generate the workload `cfg` describes, sorted by intended arrival time."""
    if cfg.num_requests <= 0:
        raise ValueError(f"num_requests must be positive, got {cfg.num_requests}")
    lens_rng = np.random.default_rng([cfg.seed, 0])
    arrival_rng = np.random.default_rng([cfg.seed, 1])
    prompts = PromptMaker(cfg.tokenizer)
    n, kind = cfg.num_requests, WorkloadKind(cfg.kind)
    arrival, burstiness = cfg.arrival, cfg.burstiness
    if kind is WorkloadKind.CODE and arrival is Arrival.POISSON:
        arrival, burstiness = Arrival.GAMMA, min(burstiness, 0.25)  # code completion comes in bursts
    times = arrival_offsets(n, cfg.request_rate, arrival, burstiness, arrival_rng)

    if kind is WorkloadKind.CONVERSATION:
        ins, outs = _long_tail_lens(lens_rng, cfg.input_len, 1.0, n), _long_tail_lens(lens_rng, cfg.output_len, 0.8, n)
    elif kind is WorkloadKind.CODE:
        ins, outs = _long_tail_lens(lens_rng, cfg.input_len, 1.2, n), _long_tail_lens(lens_rng, cfg.output_len, 0.6, n)
    else:
        ins = _uniform_lens(lens_rng, cfg.input_len, cfg.range_ratio, n)
        outs = _uniform_lens(lens_rng, cfg.output_len, cfg.range_ratio, n)

    prefixes: list[str] = []
    if kind is WorkloadKind.SHARED_PREFIX:
        prefixes = [prompts.make(cfg.prefix_len, lens_rng)[0] for _ in range(max(cfg.num_prefixes, 1))]

    specs: list[RequestSpec] = []
    for i in range(n):
        tag, prefix = kind.value, ""
        if prefixes:
            group = i % len(prefixes)
            tag, prefix = f"prefix-{group}", prefixes[group]
        target = int(ins[i]) + (cfg.prefix_len if prefix else 0)
        if kind is WorkloadKind.INTERFERENCE:
            tag = "short"
        text, count = prompts.make(target, lens_rng, prefix)
        specs.append(RequestSpec(request_id=f"{kind.value}-{i}", prompt=text, prompt_tokens=count,
                                 max_tokens=int(outs[i]), arrival_s=times[i], tag=tag))

    if kind is WorkloadKind.INTERFERENCE:
        specs.extend(_long_prompts(cfg, prompts, lens_rng, horizon=times[-1]))
        specs.sort(key=lambda s: s.arrival_s)
    return specs


def _long_prompts(cfg: WorkloadConfig, prompts: PromptMaker, rng: np.random.Generator,
                  horizon: float) -> Iterable[RequestSpec]:
    """The long prompts of the interference workload: one every `long_interval_s`, from t=interval."""
    if cfg.long_interval_s <= 0:
        raise ValueError(f"long_interval_s must be positive, got {cfg.long_interval_s}")
    # With an infinite rate all shorts arrive at t=0; still send one long prompt among them.
    count = max(1, int(horizon // cfg.long_interval_s))
    for k in range(count):
        text, n_tok = prompts.make(cfg.long_input_len, rng)
        t = (k + 1) * cfg.long_interval_s if horizon > 0 else 0.0
        yield RequestSpec(request_id=f"long-{k}", prompt=text, prompt_tokens=n_tok,
                          max_tokens=cfg.long_output_len, arrival_s=t, tag="long")


def restamp(specs: Sequence[RequestSpec], rate: float, arrival: Arrival, burstiness: float,
            seed: int) -> list[RequestSpec]:
    """The same requests with arrival times redrawn at another rate (a sweep over a JSONL file)."""
    times = arrival_offsets(len(specs), rate, arrival, burstiness, np.random.default_rng([seed, 1]))
    return [msgspec.structs.replace(s, arrival_s=t) for s, t in zip(specs, times, strict=True)]


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(RequestSpec)


def write_jsonl(path: str | Path, specs: Iterable[RequestSpec]) -> None:
    with open(path, "wb") as f:
        for spec in specs:
            f.write(_encoder.encode(spec) + b"\n")


def read_jsonl(path: str | Path) -> list[RequestSpec]:
    """Read a workload file; a malformed line is an error naming the line."""
    specs = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                specs.append(_decoder.decode(line))
            except msgspec.ValidationError as e:
                raise ValueError(f"{path}:{lineno}: not a workload request ({e})") from None
    if not specs:
        raise ValueError(f"{path}: workload file has no requests")
    return sorted(specs, key=lambda s: s.arrival_s)
