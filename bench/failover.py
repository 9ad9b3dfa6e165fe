"""What a worker's death costs: the migration gap, the prefix cache's share of the recompute, and
a soak with a worker killed every minute. Each run starts its own `pdserve up` (the default model
unless --model says otherwise) and stops it at the end.

    python -m pdserve.bench.failover gap  --tokens 8,32,128,512
    python -m pdserve.bench.failover soak --minutes 10 --kill-every 60 --rate 1
    python -m pdserve.bench.failover soak --minutes 10 --kill-every 0    # the same soak, no kills

`gap`: one greedy stream per entry of --tokens; once it has that many tokens, the decode worker
serving it gets SIGKILL. Reported: the stream's longest pause after the kill against its median
token gap before, and how many of the recomputed tokens (prompt + tokens so far) the new prefill
worker found in its prefix cache.

`soak`: open-loop Poisson arrivals for --minutes; every --kill-every seconds the next worker of
prefill-0, decode-0, prefill-1, decode-1 gets SIGKILL (`pdserve up` restarts it). Reported: the
success rate (every request must finish with its full output and no error), p50/p99 TTFT and
TBT, the kills, and the KV blocks the workers still hold once the load is gone (leaks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

from pdserve.bench.up_process import UpProcess

log = logging.getLogger(__name__)
WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "her", "an", "were", "are", "which", "this", "be"]
ALL = {"prefill": 2, "decode": 2, "colocated": 0}


def prompt_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Outcome:
    """One streamed request: when it was sent, its token arrival times, and how it ended."""

    sent: float
    times: list[float] = field(default_factory=list)
    tokens: int = 0
    prompt_tokens: int = 0
    cached: int | None = None
    error: str = ""
    request_id: str = ""

    @property
    def ttft(self) -> float | None:
        return self.times[0] - self.sent if self.times else None

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


async def stream(client: httpx.AsyncClient, body: dict, on_token=None) -> Outcome:
    out = Outcome(time.monotonic())
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                out.request_id = chunk.get("id", out.request_id)
                if "error" in chunk:
                    out.error = chunk["error"].get("message", "error")
                if chunk.get("usage"):
                    out.tokens = chunk["usage"]["completion_tokens"]
                    out.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    out.cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                if any(c.get("text") for c in chunk.get("choices") or []):
                    out.times.append(time.monotonic())
                    if on_token is not None:
                        on_token(out)
    except httpx.HTTPError as exc:
        out.error = repr(exc)
    return out


def body(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# --- gap -------------------------------------------------------------------------------------


async def run_gap(up: UpProcess, tokens: list[int], prompt_words: int, after: int) -> list[dict]:
    rng = random.Random(0)
    rows = []
    async with httpx.AsyncClient(base_url=up.base_url, timeout=300) as client:
        for k in tqdm(tokens, desc="migrations", unit="kill"):
            up.wait_workers(ALL, timeout=300)
            prompt = prompt_text(rng, prompt_words)
            killed: dict[str, float | str] = {}

            def on_token(o: Outcome, k=k, killed=killed) -> None:
                if len(o.times) == k and not killed:
                    victim = up.routes().get(o.request_id + "-0", ["?"])[-1]
                    killed["at"], killed["victim"] = time.monotonic(), victim
                    up.signal(victim, signal.SIGKILL)

            o = await stream(client, body(up.model(), prompt, k + after), on_token)
            at = float(killed.get("at", 0.0))
            before = [t for t in o.times if t <= at]
            after_kill = [t for t in o.times if t > at]
            pause = (after_kill[0] - before[-1]) if before and after_kill else None
            rows.append({
                "tokens_before_kill": k, "victim": killed.get("victim"), "error": o.error,
                "completion_tokens": o.tokens, "median_gap_ms": 1e3 * statistics.median(
                    [b - a for a, b in zip(before, before[1:], strict=False)] or [0.0]),
                "pause_ms": None if pause is None else 1e3 * pause, "cached_tokens": o.cached,
                "recomputed_tokens": o.prompt_tokens + k,
                "cached_fraction": None if not o.cached else round(o.cached / (o.prompt_tokens + k), 3),
            })
            print(json.dumps(rows[-1]), flush=True)
    return rows


# --- soak ------------------------------------------------------------------------------------


async def run_soak(up: UpProcess, minutes: float, rate: float, kill_every: float, prompt_words: int,
                   max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    duration = 60 * minutes
    outcomes: list[asyncio.Task] = []
    kills: list[dict] = []
    order = ["prefill-0", "decode-0", "prefill-1", "decode-1"]
    start = time.monotonic()

    async def killer() -> None:
        n = 0
        while kill_every > 0 and time.monotonic() - start + kill_every < duration:
            await asyncio.sleep(kill_every)
            victim = order[n % len(order)]
            n += 1
            try:
                pid = up.signal(victim, signal.SIGKILL)
            except (AssertionError, ProcessLookupError) as exc:
                log.warning("could not kill %s: %s", victim, exc)
                continue
            kills.append({"at_s": round(time.monotonic() - start, 1), "victim": victim, "pid": pid})
            log.info("killed %s (pid %d) at %.0f s", victim, pid, time.monotonic() - start)

    async with httpx.AsyncClient(base_url=up.base_url, timeout=600,
                                 limits=httpx.Limits(max_connections=1000)) as client:
        kill_task = asyncio.create_task(killer())
        with tqdm(total=int(duration), desc="soak", unit="s") as bar:
            next_at = start
            while (now := time.monotonic()) - start < duration:
                if now >= next_at:
                    b = body(up.model(), prompt_text(rng, prompt_words), max_tokens)
                    outcomes.append(asyncio.create_task(stream(client, b)))
                    next_at += rng.expovariate(rate)
                await asyncio.sleep(max(0.0, min(next_at - time.monotonic(), 1.0)))
                bar.update(int(time.monotonic() - start) - bar.n)
        kill_task.cancel()
        done: list[Outcome] = [await t for t in outcomes]
    ok = [o for o in done if not o.error and o.tokens == max_tokens]
    failed = [o for o in done if o not in ok]
    up.wait_workers(ALL, timeout=300)
    leaked = await leaked_blocks(up)
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    tbts = [g for o in ok for g in o.gaps()]
    return {
        "minutes": minutes, "rate": rate, "kill_every_s": kill_every, "requests": len(done),
        "succeeded": len(ok), "success_rate": len(ok) / max(1, len(done)),
        "failures": [{"error": o.error[:200], "tokens": o.tokens} for o in failed][:20],
        "ttft_p50_ms": _ms(pct(ttfts, 0.5)), "ttft_p99_ms": _ms(pct(ttfts, 0.99)),
        "tbt_p50_ms": _ms(pct(tbts, 0.5)), "tbt_p99_ms": _ms(pct(tbts, 0.99)),
        "kills": kills, "leaked_blocks": leaked,
        "migrations": up_metrics(up, "pdserve_router_migrations_total"),
    }


def _ms(s: float | None) -> float | None:
    return None if s is None else round(1e3 * s, 1)


def up_metrics(up: UpProcess, name: str) -> dict[str, float]:
    import re

    text = httpx.get(f"{up.base_url}/metrics", timeout=10).text
    return {m[0]: float(m[1]) for m in re.findall(rf'^{name}\{{cause="(\w+)"\}} ([0-9.e+]+)$', text, re.M)}


async def leaked_blocks(up: UpProcess, settle_s: float = 15.0) -> dict[str, float]:
    """KV blocks each worker still reports in use once nothing runs (after the KV leases end)."""
    import re

    deadline = time.monotonic() + settle_s
    while True:
        text = httpx.get(f"{up.base_url}/metrics", timeout=10).text
        used = {m[0]: float(m[1]) for m in re.findall(r'^pdserve_router_kv_blocks_used\{worker="([^"]+)",role="\w+"\} ([0-9.e+]+)$', text, re.M)}
        if not any(used.values()) or time.monotonic() > deadline:
            return used
        await asyncio.sleep(1.0)


# --- CLI -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.failover", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("gap", "soak"))
    p.add_argument("--model", default="default", help="the model every worker serves")
    p.add_argument("--out", default="bench-results/failover", help="folder for the JSON result and the log")
    p.add_argument("--tokens", default="8,32,128,512", help="gap: tokens generated before each kill")
    p.add_argument("--after", type=int, default=32, help="gap: tokens each stream generates after the kill")
    p.add_argument("--prompt-words", type=int, default=200, help="words per prompt (~1 token each)")
    p.add_argument("--minutes", type=float, default=10.0, help="soak: length")
    p.add_argument("--rate", type=float, default=1.0, help="soak: requests per second (Poisson)")
    p.add_argument("--max-tokens", type=int, default=64, help="soak: output tokens per request")
    p.add_argument("--kill-every", type=float, default=60.0, help="soak: seconds between kills (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--up-arg", action="append", default=[], help="one more argument for `pdserve up`")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.what if args.what == "gap" else f"soak-kill{int(args.kill_every)}"
    up = UpProcess(args.model, out / f"{name}-up.log", kv_cache_gb=None, args=tuple(args.up_arg)).start()
    try:
        if args.what == "gap":
            tokens = [int(t) for t in args.tokens.split(",")]
            result: object = asyncio.run(run_gap(up, tokens, args.prompt_words, args.after))
        else:
            result = asyncio.run(run_soak(up, args.minutes, args.rate, args.kill_every, args.prompt_words,
                                          args.max_tokens, args.seed))
    finally:
        up.stop()
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
