"""The KV hand-off's cost on long prompts: the gap between the first token and the second, with
the KV streamed as each prompt chunk lands (`--kv-streaming layer`) and sent whole at the end
(`request`), beside the same deployment's median decode step.

    python -m pdserve.bench.handoff_bench --model ~/.cache/pdserve-shapes/llama-3.2-1b \\
        [--prompt-tokens 4096] [--requests 5] [--modes layer,request] [--kv-transport shm] [--json PATH]

Each mode is a `pdserve up` of one prefill and one decode worker. Requests go one at a time (no
queueing, no batching: the gap is the hand-off's own), each a prompt of fresh random token ids
(no prefix-cache hit), streaming `--max-tokens` tokens. Per request the client times every token;
the gap is first -> second, the decode step the median interval after it. The router's hand-off
split (`pdserve_handoff_phase_seconds`, means over the run) says where the gap went. Build the
model with `python -m pdserve.bench.shapes llama-3.2-1b` (random weights of that architecture).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.bench.compare import READY_PATH, stop, wait_ready
from pdserve.bench.handoff_scrape import handoff_moments, handoff_split
from pdserve.bench.stage_scrape import metrics_page
from pdserve.bench.up_process import UpProcess
from pdserve.config.names import KV_STREAMING, KV_TRANSPORTS


def token_times(base_url: str, model: str, prompt: list[int], max_tokens: int, timeout: float) -> list[float]:
    """perf_counter() at each streamed token of one completion (one token per chunk)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True}
    times: list[float] = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=timeout) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if any(c.get("text") for c in chunk.get("choices", [])):
                times.append(time.perf_counter())
    return times


def run_mode(model: str, mode: str, args: argparse.Namespace, log_dir: Path) -> dict:
    extra = ("--kv-transport", args.kv_transport, "--kv-streaming", mode, "--dtype", args.dtype,
             "--max-num-batched-tokens", str(args.chunk))
    up = UpProcess(model, log_dir / f"up-{mode}.log", num_prefill=1, num_decode=1, args=extra,
                   kv_cache_gb=args.kv_cache_gb, threads=args.threads).start(timeout=600)
    moments: list[dict] = []
    try:
        row = measure(up.base_url, up.model(), mode, args,
                      after_warmup=lambda: moments.append(handoff_moments(metrics_page(up.base_url))))
        row["split"] = handoff_split(moments[0], handoff_moments(metrics_page(up.base_url)))
    finally:
        up.stop()
    return row


def run_peer(args: argparse.Namespace, log_dir: Path) -> dict:
    """The same prompts on the peer at --peer-url, started by --peer-cmd (and stopped) if given: its
    output goes to `log_dir`/peer.log, and it is waited for as `pdserve bench compare` waits."""
    peer = args.peer_url.rstrip("/")
    log_path = log_dir / "peer.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(args.peer_cmd, shell=True, start_new_session=True,  # noqa: S602 (the user's command)
                                stdout=log_file, stderr=subprocess.STDOUT) if args.peer_cmd else None
        try:
            if proc is not None:
                wait_ready(proc, peer + READY_PATH, args.timeout, log_path)
            served = httpx.get(f"{peer}/v1/models", timeout=5).json()["data"][0]["id"]
            print(f"{args.peer_name}: {args.requests} prompts of {args.prompt_tokens} tokens, {served}", flush=True)
            return measure(peer, served, args.peer_name, args)
        finally:
            if proc is not None:
                stop(proc, 60.0)


def measure(base_url: str, model: str, label: str, args: argparse.Namespace,
            after_warmup=lambda: None) -> dict:
    """The gap, decode step and TTFT of `args.requests` prompts (after one warm-up) on a server."""
    rng = random.Random(args.seed)  # the same prompts for every mode and peer
    gaps, steps, ttfts = [], [], []
    for i in range(args.requests + 1):  # the first warms the server up
        prompt = [rng.randrange(1000, 30000) for _ in range(args.prompt_tokens)]
        sent = time.perf_counter()
        times = token_times(base_url, model, prompt, args.max_tokens, args.timeout)
        if len(times) < 3:
            raise RuntimeError(f"{label}: request {i} streamed {len(times)} tokens")
        if i == 0:
            after_warmup()
            continue
        ttfts.append(times[0] - sent)
        gaps.append(times[1] - times[0])
        steps += [b - a for a, b in zip(times[1:], times[2:], strict=False)]
        print(f"  {label}: request {i}: TTFT {ttfts[-1]:.2f} s, gap {gaps[-1] * 1e3:.1f} ms, "
              f"decode step {statistics.median(steps) * 1e3:.1f} ms", flush=True)
    step = statistics.median(steps)
    gap = statistics.median(gaps)
    return {"mode": label, "requests": len(gaps), "gap_p50_ms": gap * 1e3, "gap_max_ms": max(gaps) * 1e3,
            "decode_step_p50_ms": step * 1e3, "gap_over_step": gap / step, "ttft_p50_s": statistics.median(ttfts),
            "gaps_ms": [g * 1e3 for g in gaps], "split": {}}


def table(rows: list[dict]) -> str:
    out = ["| --kv-streaming | gap p50 (ms) | gap / decode step | decode step p50 (ms) | wait / send / verify / "
           "load, means (ms) | parts | TTFT p50 (s) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r.get("split") or {}
        phases = " / ".join(f"{s[f'mean_{p}_ms']:.1f}" for p in ("wait", "send", "verify", "load")) if s else "-"
        parts = f"{s['mean_parts']:.1f}" if s else "-"
        out.append(f"| {r['mode']} | {r['gap_p50_ms']:.1f} | {r['gap_over_step']:.2f}x | {r['decode_step_p50_ms']:.1f} "
                   f"| {phases} | {parts} | {r['ttft_p50_s']:.2f} |")
    ours = [r for r in rows if r.get("split")]
    if len(ours) == 2:
        out.append(f"\nThe gap with {ours[0]['mode']} streaming is {ours[1]['gap_p50_ms'] / ours[0]['gap_p50_ms']:.2f}x "
                   f"shorter than with {ours[1]['mode']}.")
    for peer in (r for r in rows if not r.get("split")):
        for r in ours:
            out.append(f"{r['mode']}: gap {r['gap_p50_ms'] / peer['gap_p50_ms']:.2f}x and TTFT "
                       f"{r['ttft_p50_s'] / peer['ttft_p50_s']:.2f}x {peer['mode']}'s (colocated, no hand-off).")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(Path.home() / ".cache/pdserve-shapes/llama-3.2-1b"),
                   help="the model both workers serve (default: Llama-3.2-1B's shape, as bench.shapes writes it)")
    p.add_argument("--prompt-tokens", type=int, default=4096, help="tokens of each prompt")
    p.add_argument("--requests", type=int, default=5, help="timed requests per mode")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens streamed per request")
    p.add_argument("--modes", default=",".join(KV_STREAMING), help="the --kv-streaming values to measure, in turn")
    p.add_argument("--kv-transport", default="shm", choices=KV_TRANSPORTS, help="between the two workers")
    p.add_argument("--dtype", default="bfloat16", help="the workers' --dtype")
    p.add_argument("--chunk", type=int, default=512, help="--max-num-batched-tokens")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="each worker's --kv-cache-memory-gb")
    p.add_argument("--threads", type=int, default=2, help="each worker's --threads (unpinned)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--seed", type=int, default=0, help="of the random prompts")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--peer-url", default="",
                   help="also time the same prompts on this OpenAI-compatible server of the same model, after "
                        "pdserve's runs: its first-to-second token time (colocated, no hand-off)")
    p.add_argument("--peer-cmd", default="",
                   help="the shell command that starts that server: run once pdserve's deployments are gone (a "
                        "2-core, 24 GiB machine holds one at a time), waited for as bench compare waits (/ready, "
                        "else /health; an error shows its output's tail if it never answers), stopped after")
    p.add_argument("--peer-name", default="peer", help="the peer's name in the table")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdserve-handoff-") as tmp:
        for mode in [m for m in args.modes.split(",") if m]:
            print(f"{mode}: {args.requests} prompts of {args.prompt_tokens} tokens, {args.model}", flush=True)
            rows.append(run_mode(args.model, mode, args, Path(tmp)))
        if args.peer_url:
            rows.append(run_peer(args, Path(tmp)))
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
