"""Pipeline bubbles: every batching policy with and without 2 pipeline stages, in one run.

    python -m pdserve.bench.pipeline_bench [--model default] [--out docs/results/pipeline]

On a machine of C cores: each deployment without stages is one process with C threads; with
2 stages each stage gets C/2 cores (--pp-pin). Per workload (the interference mix: 64-token chats
at 4 requests/s with a 1,024-token prompt every 6th; W1: 64 prompts of 256 tokens, 64 out, all at
once) and per policy
(prefill-first, mixed, chunked, and a decode-only pipeline fed by a prefill engine), it reports
throughput, goodput under the SLO, TTFT and TBT, and with stages the bubble fraction of each
stage over the run and the activation hand-off (stage 0's end to stage 1's start of a
micro-batch that stage 1 waited for). It draws each pipelined run's micro-batches per stage (a
Gantt chart) for a window around the first long prompt. Then the TTFT of one 4,096-token prompt,
chunked through 2 stages, against one process of C threads.

The disaggregated case hands the KV over shared memory from a prefill engine (1 stage, chunked,
capped at the first token) that runs first, alone, on one thread: each request then enters the
decode pipeline at its arrival plus its TTFT there (the decode stages take both cores of a 2-core
machine; this is how the prefill gets a core of its own). Every option `--foo-bar` defaults to PDSERVE_FOO_BAR when set.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from pdserve.bench.offline_policies import Workload, percentile_ms
from pdserve.config.envs import flag_default
from pdserve.config.names import CHUNKED, DECODE_ONLY, MIXED, PREFILL_FIRST

log = logging.getLogger(__name__)

DISAGGREGATED = "disaggregated"  # a prefill engine feeding a decode-only engine
POLICIES = (PREFILL_FIRST, MIXED, CHUNKED, DISAGGREGATED)
# Both keep the pipeline loaded (a bubble is a stage waiting while there is work): the
# interference mix arrives faster than one process serves it; W1 all at once (its saturation).
WORKLOADS = {
    "interference": Workload(num_requests=48, rate=4.0, long_every=6, short_len=64, long_len=1024, output_len=32),
    "w1": Workload(num_requests=64, rate=float("inf"), long_every=0, short_len=256, output_len=64),
}


@dataclass(slots=True)
class Run:
    workload: str
    policy: str
    stages: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    goodput: float  # requests/s that met the SLO
    p50_ttft_ms: float
    p99_ttft_ms: float
    p50_tbt_ms: float
    p99_tbt_ms: float
    bubble_fraction: list[float] = field(default_factory=list)  # per stage, idle / wall over the run
    bubble_in_flight: list[float] = field(default_factory=list)  # idle / time a micro-batch was in flight
    handoff_ms: float = float("nan")  # median activation hand-off, stage 0 -> 1
    micro_batches: int = 0
    timeline: str = ""  # the Gantt chart's path


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float
    tbt_ms: float  # each request's p99 gap

    def met(self, ttft_s: float, gaps: list[float]) -> bool:
        p99 = float(np.percentile(gaps, 99)) * 1e3 if gaps else 0.0
        return ttft_s * 1e3 <= self.ttft_ms and p99 <= self.tbt_ms


def engine_config(model: str, policy: str, stages: int, work: Workload, budget: int, block_size: int = 16,
                  split: str | None = None):
    from pdserve.config.engine import EngineConfig

    longest = max(work.short_len, work.long_len) + work.output_len
    blocks = sum(-(-(work.prompt_len(i) + work.output_len) // block_size) for i in range(work.num_requests)) + 16
    whole = policy in (PREFILL_FIRST, MIXED)
    return EngineConfig(model=model, policy=policy, pipeline_parallel_size=stages, max_model_len=longest + block_size,
                        pp_layer_split=split if stages > 1 else None,
                        num_kv_blocks=blocks, max_num_seqs=max(64, work.num_requests),
                        max_num_batched_tokens=max(budget, longest + block_size) if whole else budget)


def hand_offs(timeline, start: float, end: float) -> tuple[float, int]:
    """Median wait between stage 0's end and stage 1's start of a micro-batch that stage 1 was
    idle for (so the gap is the transfer, not a queue), in ms; and the micro-batch count."""
    by_mb: dict[int, dict[int, tuple[float, float]]] = {}
    for iv in timeline.window(start, end):
        if iv.kind == "layers":
            by_mb.setdefault(iv.micro_batch, {})[iv.stage] = (iv.start, iv.end)
    gaps, last_end1 = [], -1.0
    for mb in sorted(by_mb):
        s = by_mb[mb]
        if 0 in s and 1 in s:
            if last_end1 <= s[0][1]:  # stage 1 was free when stage 0 finished
                gaps.append(s[1][0] - s[0][1])
            last_end1 = s[1][1]
    return (statistics.median(gaps) * 1e3 if gaps else float("nan")), len(by_mb)


def gantt(timeline, start: float, end: float, title: str, path: Path) -> Path:
    """Micro-batches per stage over [start, end]: steps with prompt tokens red, decode-only blue,
    the first stage's LM head and sampler grey; white is a bubble."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.6 * timeline.num_stages))
    for iv in timeline.window(start, end):
        color = "0.6" if iv.kind == "head" else ("tab:red" if iv.tokens > 64 else "tab:blue")
        ax.broken_barh([((iv.start - start) * 1e3, (iv.end - iv.start) * 1e3)], (iv.stage - 0.4, 0.8),
                       facecolors=color, edgecolors="white", linewidth=0.3)
    ax.set(xlim=(0, (end - start) * 1e3), ylim=(timeline.num_stages - 0.5, -0.5), xlabel="ms", title=title,
           yticks=range(timeline.num_stages), yticklabels=[f"stage {k}" for k in range(timeline.num_stages)])
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="tab:red", label="with prompt tokens"), Patch(color="tab:blue", label="decodes"),
                       Patch(color="0.6", label="LM head + sampler")], loc="upper right", fontsize="small", ncol=3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def colocated(loaded, model: str, policy: str, stages: int, work: Workload, budget: int, split: str | None = None):
    """One run: (outputs as (arrival, token times)), the engine's timeline and window."""
    from pdserve.engine.llm import LLM
    from pdserve.protocol.sampling import SamplingParams

    prompts, offsets = work.build(loaded.config.vocab_size)
    llm = LLM(loaded=loaded, config=engine_config(model, policy, stages, work, budget, split=split))
    try:
        llm.generate([list(range(1000, 1000 + work.short_len))] * 2,
                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        t0 = time.monotonic()
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=work.output_len, ignore_eos=True),
                            use_tqdm=False, arrival_offsets=offsets)
        t1 = time.monotonic()
        shift = time.time() - time.monotonic()  # token times are wall-clock; the timeline monotonic
        return [(o.arrival_time - shift, [t - shift for t in o.token_times]) for o in outs], llm.engine, (t0, t1)
    finally:
        llm.engine.close()


def disaggregated(loaded, model: str, stages: int, work: Workload, budget: int, split: str | None = None):
    """A prefill engine and a decode-only engine of `stages` stages, KV over shared memory. The
    prefill engine runs first, alone, on one thread, the prompts arriving in real time (so each
    request's TTFT is what a prefill worker with a core of its own would give); then each request
    enters the decode pipeline at its arrival plus that TTFT, its KV waiting in the receiver, and
    the decode engine runs as a decode worker's loop would. On a 2-core machine whose cores the
    decode stages take, that is how the prefill gets a core of its own."""
    import torch

    from pdserve.engine.engine import Engine, context_length
    from pdserve.engine.kv_connector import KVConnector
    from pdserve.kvtransfer.connector import (
        DecodeConnector,
        HandoffTarget,
        PrefillConnector,
        first_token_only,
    )
    from pdserve.kvtransfer.transport import ReceivedKV, make_receiver
    from pdserve.protocol.sampling import SamplingParams
    from pdserve.worker.loop import model_fingerprint

    prompts, offsets = work.build(loaded.config.vocab_size)
    cfg = engine_config(model, CHUNKED, 1, work, budget)
    fp = model_fingerprint(cfg, loaded)
    out_conn = PrefillConnector(fp, "prefill-bench", context_length(cfg, loaded.config), lease_s=600.0)
    prefill = Engine(cfg, loaded, KVConnector(out_conn, out_conn))
    in_conn = DecodeConnector()
    decode = Engine(replace(cfg, policy=DECODE_ONLY, pipeline_parallel_size=stages,
                            pp_layer_split=split if stages > 1 else None), loaded,
                    KVConnector(in_conn, in_conn))
    receiver = make_receiver("shm", "tcp://127.0.0.1:0", fingerprint=fp)
    params = SamplingParams(temperature=0.0, max_tokens=work.output_len, ignore_eos=True)
    ids = [f"req-{i}" for i in range(len(prompts))]
    ttft: dict[str, float] = {}
    kv: dict[str, ReceivedKV] = {}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the prefill worker's one core
        start = time.monotonic()
        pending = list(range(len(prompts)))
        while pending or len(kv) < len(prompts):
            now = time.monotonic()
            while pending and start + offsets[pending[0]] <= now:
                i = pending.pop(0)
                prefill.add_request(ids[i], prompts[i], first_token_only(params))
                out_conn.expect(ids[i], HandoffTarget(receiver.address, "shm", params))
            if prefill.has_unfinished():
                for o in prefill.step():
                    if o.new_token_ids:
                        ttft[o.request_id] = time.monotonic() - start - offsets[int(o.request_id.removeprefix("req-"))]
                prefill.save_kv()
            else:
                time.sleep(0.0005)
            for rkv in receiver.poll(timeout=0.0):  # held until the decode replay admits it
                kv[rkv.meta.request_id] = rkv
        torch.set_num_threads(threads)
        release = sorted(range(len(prompts)), key=lambda i: offsets[i] + ttft[ids[i]])
        times: dict[str, list[float]] = {}
        start = time.monotonic()
        while release or any(len(t) < work.output_len for t in times.values()) or len(times) < len(prompts):
            now = time.monotonic()
            while release and start + offsets[release[0]] + ttft[ids[release[0]]] <= now:
                i = release.pop(0)
                rkv = kv.pop(ids[i])
                in_conn.expect(rkv)
                m = rkv.meta
                decode.add_request(m.request_id, list(m.prompt_token_ids), m.sampling,
                                   output_token_ids=list(m.output_token_ids))
                times[ids[i]] = [start + offsets[i] + ttft[ids[i]]]
            if decode.has_unfinished():
                for o in decode.step():
                    times[o.request_id] += [time.monotonic()] * len(o.new_token_ids)
            else:
                time.sleep(0.0005)
            for r in in_conn.take_results():
                receiver.ack(r.request_id, r.ok, r.reason)
            out_conn.poll_acks()
        end = time.monotonic()
        return [(start + offsets[i], times[ids[i]]) for i in range(len(prompts))], decode, (start, end)
    finally:
        torch.set_num_threads(threads)
        out_conn.close()
        receiver.close()
        prefill.close()
        decode.close()


def measure(loaded, model: str, name: str, work: Workload, policy: str, stages: int, budget: int, slo: Slo,
            out: Path, split: str | None = None) -> Run:
    if policy == DISAGGREGATED:
        results, engine, (t0, t1) = disaggregated(loaded, model, stages, work, budget, split)
    else:
        results, engine, (t0, t1) = colocated(loaded, model, policy, stages, work, budget, split)
    first = min(a for a, _ in results)
    last = max(ts[-1] for _, ts in results)
    duration = last - first
    ttfts = [ts[0] - a for a, ts in results]
    gaps = [[b - a for a, b in zip(ts, ts[1:], strict=False)] for _, ts in results]
    met = sum(slo.met(t, g) for t, g in zip(ttfts, gaps, strict=True))
    run = Run(name, policy, stages, duration, len(results) / duration, sum(len(ts) for _, ts in results) / duration,
              met / duration, percentile_ms(ttfts, 50), percentile_ms(ttfts, 99),
              percentile_ms([x for g in gaps for x in g], 50), percentile_ms([x for g in gaps for x in g], 99))
    pipe = engine.pipeline
    if pipe is not None:
        run.bubble_fraction = [round(f, 4) for f in pipe.timeline.between(t0, t1)]
        run.bubble_in_flight = [round(f, 4) for f in pipe.timeline.in_flight_between(t0, t1)]
        run.handoff_ms, run.micro_batches = hand_offs(pipe.timeline, t0, t1)
        # The window: from the first long prompt's arrival (or the run's middle), 1.5 s.
        longs = [a for i, (a, _) in enumerate(results) if work.prompt_len(i) == work.long_len and work.long_every]
        w0 = (longs[0] - 0.1) if longs else first + duration / 2
        run.timeline = str(gantt(pipe.timeline, w0, w0 + 1.5, f"{name}, {policy}, 2 stages",
                                 out / f"gantt-{name}-{policy}.png"))
    gc.collect()
    return run


def long_prompt_ttft(loaded, model: str, tokens: int, budget: int, reps: int, split: str | None = None) -> dict:
    """TTFT of one `tokens`-token prompt: 2 stages with chunked pipelining against 1 process."""
    import torch

    from pdserve.engine.llm import LLM
    from pdserve.protocol.sampling import SamplingParams

    prompt = [1000 + (i * 7919) % 30000 for i in range(tokens)]
    result = {}
    for stages in (1, 2):
        cfg = engine_config(model, CHUNKED, stages, Workload(num_requests=1, short_len=tokens, long_every=0,
                                                              output_len=1), budget, split=split)
        threads = torch.get_num_threads()
        llm = LLM(loaded=loaded, config=cfg)
        try:
            llm.generate([prompt[:64]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            times = []
            for r in range(reps):
                p = [prompt[0] + r + 1, *prompt[1:]]  # no prefix-cache hit between reps
                t = time.monotonic()
                llm.generate([p], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
                times.append(time.monotonic() - t)
        finally:
            llm.engine.close()
        result[f"stages_{stages}_s"] = statistics.median(times)
        result[f"stages_{stages}_threads"] = threads
    result["ratio_1_over_2"] = result["stages_1_s"] / result["stages_2_s"]
    return result


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.pipeline_bench", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model", default=flag_default("model", "default"))
    p.add_argument("--workloads", default=flag_default("workloads", ",".join(WORKLOADS)))
    p.add_argument("--policies", default=flag_default("policies", ",".join(POLICIES)))
    p.add_argument("--max-num-batched-tokens", type=int, default=flag_default("max-num-batched-tokens", 128),
                   help="the chunked policy's (and the prefill engine's) step budget")
    p.add_argument("--slo", default=flag_default("slo", "ttft=1000,tbt=150"), help="ms: TTFT, each request's p99 TBT")
    p.add_argument("--long-prompt", type=int, default=flag_default("long-prompt", 4096),
                   help="tokens of the TTFT comparison's prompt (0: skip it)")
    p.add_argument("--chunk", type=int, default=flag_default("chunk", 512), help="its chunk size")
    p.add_argument("--reps", type=int, default=flag_default("reps", 3))
    p.add_argument("--pp-layer-split", default=flag_default("pp-layer-split", None),
                   help="the 2 stages' layers, e.g. 12,18 (default: even)")
    p.add_argument("--out", default=flag_default("out", "bench-results/pipeline"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    from pdserve.bench.report import format_table, write_json
    from pdserve.model.weights import load_model

    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    slo_parts = dict(kv.split("=") for kv in args.slo.split(","))
    slo = Slo(float(slo_parts["ttft"]), float(slo_parts["tbt"]))
    out = Path(args.out)
    loaded = load_model(args.model)
    runs: list[Run] = []
    for name in args.workloads.split(","):
        work = WORKLOADS[name]
        for policy in args.policies.split(","):
            for stages in (1, 2):
                t = time.time()
                runs.append(measure(loaded, args.model, name, work, policy, stages, args.max_num_batched_tokens, slo, out,
                                    args.pp_layer_split))
                print(f"{name} {policy} stages={stages}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    ttft = (long_prompt_ttft(loaded, args.model, args.long_prompt, args.chunk, args.reps, args.pp_layer_split)
            if args.long_prompt else {})
    header = ["workload", "policy", "stages", "req/s", "goodput", "TTFT p50", "TTFT p99", "TBT p50", "TBT p99",
              "idle/wall", "in flight", "hand-off ms"]
    rows = [[r.workload, r.policy, r.stages, round(r.request_throughput, 3), round(r.goodput, 3),
             round(r.p50_ttft_ms), round(r.p99_ttft_ms), round(r.p50_tbt_ms, 1), round(r.p99_tbt_ms, 1),
             "/".join(f"{f:.2f}" for f in r.bubble_fraction) or "-",
             "/".join(f"{f:.2f}" for f in r.bubble_in_flight) or "-",
             f"{r.handoff_ms:.2f}" if r.bubble_fraction else "-"] for r in runs]
    print(f"model {loaded.name}, CPU {cpu_name()}, {cores} cores; SLO {args.slo}")
    print(format_table(header, rows))
    if ttft:
        print(f"{args.long_prompt}-token prompt TTFT: 1 process {ttft['stages_1_s']:.2f} s, 2 stages "
              f"{ttft['stages_2_s']:.2f} s (ratio {ttft['ratio_1_over_2']:.2f})")
    write_json(out / "pipeline.json", {"model": loaded.name, "cpu": cpu_name(), "cores": cores, "slo": args.slo,
                                       "workloads": {n: asdict(WORKLOADS[n]) for n in args.workloads.split(",")},
                                       "runs": [asdict(r) for r in runs], "long_prompt_ttft": ttft})
    print(json.dumps({"written": str(out / "pipeline.json")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
