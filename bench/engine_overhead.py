"""Engine overhead and roofline: decode steps and prefills next to the model's bare matmuls and
next to what this machine can do at best.

    python -m pdserve.bench.engine_overhead [--threads 1] [--model default|DIR|FILE.gguf] [--dtype float32]
                                            [--prefill 64,256,1024] [--json PATH]

Any model pdserve serves: `--model DIR` takes a Hugging Face directory (bench/shapes.py writes real
models' shapes), and `--json` keeps every case's figures for the results page (bench/results.sh's
shapes stage).

The same run measures the machine: its GEMM rate (the best of square and prefill-shaped torch
matmuls in the engine's dtype, and of the engine's own linear on the prefill shape) and its
memory read bandwidth (a sum over a tensor far larger than the caches), both the best of the
repeats. It measures them right before and right after each case and takes the better of the
two for that case: on a VM that shares its host, the bandwidth a sum reads can double within
minutes, and a figure taken once at the start may be another machine's by the last case. For
each case it times (a) one engine step through the scheduler, runner, paged attention and
sampler (for decode, the median of the repeats after 4 untimed steps: the steady state), and (b)
only the matmuls of the same model on the same number of tokens (every projection of every
layer plus the LM head rows that sample). a/b is the engine's overhead: attention, norms, rotary,
packing, sampling and Python.

The roofline of a step is the larger of its bytes over the bandwidth (every weight once, plus
every KV byte a decode reads) and its FLOPs over the GEMM rate (matmuls and attention); "of
roofline" is roofline / measured, 1.0 at the limit, with the machine's figures around the case;
the last line gives the same against the best figures of the whole run (the stricter). For
a prefill, "of GEMM" is its FLOP rate over the machine's GEMM rate. Where the last-level cache
holds a good part of the weights (as repeated decode steps leave them on a CPU with a large L3),
a small-batch decode step can come close to or beat its roofline: the bandwidth is that of a
tensor larger than the caches.

After the steps, W1 offline (`--w1 N`, 64 by default): N prompts of 256 tokens with 64 output
tokens each, all added at once and run to the last token through the engine's scheduling (the
engine's policy, a 1,024-token budget), against W1's roofline: every prompt's FLOPs over the GEMM
rate, plus one decode step of the whole batch per output token after the first, each the larger
of its bytes over the bandwidth and its FLOPs over the GEMM rate. It has no HTTP and no router:
`bash bench/results.sh`'s saturation stage measures the served W1 against the peers.

"1T GB/s" is the same sum on one thread, for reading the bandwidth column: where the host lets
each core stream at its own limit, the threads together read about that times the thread count,
and every part of a step that runs on one thread (the engine's Python, the sampler, a lone
sequence's attention, the waits at each projection's join) costs that many times its share of
the roofline; where the host caps the whole VM, one thread already reads about what all do. The
same build's fractions differ between the two states (docs/cpu_kernels.md, "Measuring").
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.bench.report import write_json
from pdserve.config.engine import add_engine_arguments, engine_config
from pdserve.engine.engine import Engine
from pdserve.kernels.huge_pages import zeros_on_huge_pages
from pdserve.kernels.linear import Linear
from pdserve.model.llama import DecoderLayer
from pdserve.model.weights import load_model
from pdserve.protocol.sampling import SamplingParams


def machine_gemm_rate(dtype: torch.dtype, repeats: int, engine_linear: Linear | None = None) -> float:
    """The best FLOP/s of the GEMMs this machine runs: the fastest of `repeats` runs each of a
    2048-square torch matmul, of a 1024 x 576 x 3072 one (a prefill's MLP projection), and, given
    `engine_linear` (one of the engine's projections, packed as the engine packs it), of 1,024 rows
    through it: where pdserve's kernel beats torch's, torch's rate is not the machine's limit. The
    best, not the median: a roofline is what the machine can do, and noise only slows."""
    cases = []
    for m, k, n in ((2048, 2048, 2048), (1024, 576, 3072)):
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        cases.append((functools.partial(torch.matmul, a, b), 2.0 * m * k * n))
    if engine_linear is not None:
        n, k = engine_linear.weight.shape
        cases.append((functools.partial(engine_linear, torch.randn(1024, k, dtype=dtype), tile_order=True), 2.0 * 1024 * k * n))
    best = 0.0
    with torch.inference_mode():
        for run, flops in cases:
            run()
            for _ in range(repeats):
                t = time.perf_counter()
                run()
                best = max(best, flops / (time.perf_counter() - t))
    return best


def bandwidth_tensors(megabytes: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Two float32 tensors much larger than any cache for machine_bandwidth, on 4 KiB pages and on
    transparent huge pages (where the kernel grants them: the KV cache and the packed weights
    live there)."""
    return (torch.ones(megabytes * 2**20 // 4),
            zeros_on_huge_pages((megabytes * 2**20 // 4,), torch.float32).fill_(1.0))


def machine_bandwidth(repeats: int, tensors: tuple[torch.Tensor, ...]) -> float:
    """The best bytes/s read by a sum over each of `tensors` (bandwidth_tensors())."""
    best = 0.0
    for x in tensors:
        x.sum()
        for _ in range(repeats):
            t = time.perf_counter()
            x.sum()
            best = max(best, x.numel() * 4 / (time.perf_counter() - t))
    return best


def step_cost(engine: Engine, tokens: int, sampled_rows: int, context: int, decode: bool) -> tuple[float, float]:
    """(FLOPs, bytes) of one step: weight matmuls, attention, and for decode the KV it reads."""
    model, cfg = engine.runner.model, engine.runner.model.config
    assert model.lm_head is not None, "one stage: the whole model"
    elem = engine.runner.kv_cache.element_size()
    layer_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head)
    head_params = model.lm_head.weight.numel()
    flops = 2.0 * layer_params * tokens + 2.0 * head_params * sampled_rows
    # Scores and weighted values: 2 matmuls of [tokens, D] by [D, keys] per query head and layer.
    keys = context if decode else (tokens + 1) / 2  # a prefill's causal rows see half on average
    flops += 4.0 * tokens * keys * cfg.num_heads * cfg.head_dim * cfg.num_layers
    weight_bytes = (layer_params + head_params) * model.lm_head.weight.element_size()
    kv_bytes = tokens * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem if decode else 0
    return flops, float(weight_bytes + kv_bytes)


def bare_matmuls(engine: Engine, tokens: int, sampled_rows: int, repeats: int) -> float:
    """Median seconds of every weight matmul of the model for `tokens` tokens, each through the
    model's own Linear (so oneDNN-packed where the runner packed them)."""
    model = engine.runner.model
    assert model.lm_head is not None, "one stage: the whole model"
    linears = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    dtype = model.lm_head.weight.dtype
    x = {m.weight.shape[1]: torch.randn(tokens, m.weight.shape[1], dtype=dtype) for m in linears}
    head = torch.randn(sampled_rows, model.lm_head.weight.shape[1], dtype=dtype)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t = time.perf_counter()
            for m in linears:  # a gate/up's columns as its tiles give them: no reordering copy
                m(x[m.weight.shape[1]], tile_order=True)
            model.lm_head(head)
            times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


# Decode steps run and not timed after the prefills: the first few after a prefill are slower than
# the steady state a server decodes in, while the prefill's activations leave the caches, and a
# median of 5 right after the prefill would include them.
WARMUP_DECODE_STEPS = 4


def decode_step_time(engine: Engine, batch: int, context: int, repeats: int) -> float:
    # Room for every token the early requests decode while the later ones still prefill, a step's
    # token budget at a time, so that each timed step decodes the whole batch; aborted after.
    prefill_steps = -(-batch * context // engine.scheduler.config.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=repeats + WARMUP_DECODE_STEPS + 8 + prefill_steps,
                            ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", [1 + (i * 7 + j) % 1000 for j in range(context)], params)
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(WARMUP_DECODE_STEPS):
        engine.step()
    times = []
    for _ in range(repeats):
        if len(engine.scheduler.running) != batch:
            raise RuntimeError(f"a timed decode step at batch {batch} ran {len(engine.scheduler.running)} requests")
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.abort([f"d{batch}-{i}" for i in range(batch)])
    return statistics.median(times)


def prefill_time(engine: Engine, tokens: int, repeats: int) -> float:
    times = []
    for r in range(repeats):
        engine.add_request(f"p{tokens}-{r}", [1 + (r * 13 + j) % 5000 for j in range(tokens)],
                           SamplingParams(temperature=0.0, max_tokens=1))
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@dataclasses.dataclass(frozen=True, slots=True)
class Burst:
    """W1 offline: `requests` prompts of `prompt` tokens, `output` tokens each, all at once."""

    requests: int = 64
    prompt: int = 256
    output: int = 64


def burst_time(engine: Engine, burst: Burst) -> float:
    """Seconds from adding every request of the burst to the last one's last token, through the
    engine's own scheduling (policy and token budget as configured)."""
    params = SamplingParams(temperature=0.0, max_tokens=burst.output, ignore_eos=True)
    t = time.perf_counter()
    for i in range(burst.requests):
        engine.add_request(f"w1-{i}", [1 + (i * 31 + j) % 5000 for j in range(burst.prompt)], params)
    while engine.scheduler.running or engine.scheduler.waiting:
        engine.step()
    return time.perf_counter() - t


def burst_roofline(engine: Engine, burst: Burst, gemm: float, bandwidth: float) -> tuple[float, float]:
    """(prefill, decode) seconds of the burst at the machine's limits: every prompt's FLOPs over
    the GEMM rate, then its output tokens after the first as decode steps of the whole batch (the
    context growing a token a step), each the larger of its bytes over the bandwidth and its
    FLOPs over the GEMM rate."""
    flops, _ = step_cost(engine, burst.prompt, 1, 0, decode=False)
    prefill = burst.requests * flops / gemm
    decode = 0.0
    for k in range(1, burst.output):
        flops, nbytes = step_cost(engine, burst.requests, burst.requests, burst.prompt + k, decode=True)
        decode += max(nbytes / bandwidth, flops / gemm)
    return prefill, decode


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(p)  # --model, --dtype, --threads (here 0 means 1), --cpu-linear, --fused-ops, ...
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--context", type=int, default=256, help="tokens already in each decoding request")
    p.add_argument("--prefill", type=_token_counts, default=(64, 256, 1024),
                   help="prompt lengths of the prefill cases, comma-separated (default: 64,256,1024)")
    p.add_argument("--json", type=Path, help="also write every case's figures to this JSON file")
    p.add_argument("--w1", type=int, default=64, metavar="N",
                   help="W1 offline after the steps: N prompts of 256 tokens, 64 output tokens, all at once, "
                        "against its roofline (0: not run)")
    p.add_argument("--profile", action="store_true",
                   help="instead: torch.profiler's breakdown of a decode step and a prefill (see --batch, --tokens)")
    p.add_argument("--batch", type=int, default=32, help="with --profile: the decode step's batch")
    p.add_argument("--tokens", type=int, default=256, help="with --profile: the prefill's prompt tokens")
    p.add_argument("--per-op", action="store_true",
                   help="with --profile: steps through the PyTorch layers, so each compiled op shows on its own "
                        "instead of inside one decoder_layers_ call")
    args = p.parse_args(argv)
    args.threads = args.threads or 1
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    config = dataclasses.replace(engine_config(args), max_num_batched_tokens=1024, max_num_seqs=64,
                                 enable_prefix_caching=False)
    engine = Engine(config, loaded=loaded)
    if engine.runner.kv_fault_in is not None:  # a server's steady state: its KV cache resident
        engine.runner.kv_fault_in.join()
    if args.profile:
        if args.per_op:
            engine.runner.model.use_compiled_layers(None)
        profile(engine, args.context, args.repeats, batch=args.batch, prefill_tokens=args.tokens)
        return
    dtype = engine.runner.dtype
    first = engine.runner.model.model.layers[0]
    assert isinstance(first, DecoderLayer)
    tensors = bandwidth_tensors()
    best = {"gemm": 0.0, "bandwidth": 0.0}

    def machine() -> tuple[float, float, float]:
        gemm = machine_gemm_rate(dtype, args.repeats, first.mlp.gate_up_proj)
        bandwidth = machine_bandwidth(args.repeats, tensors)
        torch.set_num_threads(1)
        one_thread = machine_bandwidth(args.repeats, tensors)
        torch.set_num_threads(args.threads)
        best["gemm"], best["bandwidth"] = max(best["gemm"], gemm), max(best["bandwidth"], bandwidth)
        return gemm, bandwidth, one_thread

    print(f"model {loaded.name}, {str(dtype).removeprefix('torch.')}, attention {engine.runner.backend.name}, "
          f"linears {engine.runner.cpu_linear}, deterministic {'on' if engine.runner.deterministic else 'off'}, "
          f"{args.threads} thread(s), median of {args.repeats}, CPU {cpu_name()}")
    print("machine: GEMM rate and memory read measured before and after each case, the better of the two")
    print(f"{'case':<22}{'engine ms':>10}{'matmuls ms':>11}{'ratio':>6}{'tokens/s':>9}{'GFLOP/s':>8}{'GB/s':>6}"
          f"{'1T GB/s':>8}{'roofline ms':>12}{'of roofline':>12}{'of GEMM':>8}")
    rows = []
    cases: list[dict] = []

    def case(name: str, tokens: int, run: Callable[[], float], sampled: int, context: int, decode: bool) -> None:
        before = machine()
        e = run()
        m = bare_matmuls(engine, tokens, sampled, args.repeats)
        after = machine()
        gemm, bandwidth, one_thread = (max(b, a) for b, a in zip(before, after, strict=True))
        flops, nbytes = step_cost(engine, tokens, sampled, context, decode=decode)
        roof = max(nbytes / bandwidth, flops / gemm)
        print(f"{name:<22}{e * 1e3:>10.1f}{m * 1e3:>11.1f}{e / m:>6.2f}{tokens / e:>9.1f}{gemm / 1e9:>8.0f}"
              f"{bandwidth / 1e9:>6.1f}{one_thread / 1e9:>8.1f}{roof * 1e3:>12.1f}{roof / e:>12.2f}{flops / e / gemm:>8.2f}", flush=True)
        rows.append((e, flops, nbytes))
        cases.append({"case": name, "kind": "decode" if decode else "prefill", "tokens": tokens, "context": context,
                      "engine_s": e, "matmuls_s": m, "flops": flops, "bytes": nbytes, "gemm_flops_s": gemm,
                      "read_bytes_s": bandwidth, "one_thread_read_bytes_s": one_thread, "roofline_s": roof})

    for batch in (1, 8, 32):
        case(f"decode batch {batch}", batch,
             functools.partial(decode_step_time, engine, batch, args.context, args.repeats), batch, args.context, True)
    for tokens in args.prefill:
        case(f"prefill {tokens} tokens", tokens, functools.partial(prefill_time, engine, tokens, args.repeats), 1, 0,
             False)
    strict = [max(nbytes / best["bandwidth"], flops / best["gemm"]) / e for e, flops, nbytes in rows]
    print(f"the run's best: GEMM {best['gemm'] / 1e9:.1f} GFLOP/s, memory read {best['bandwidth'] / 1e9:.1f} GB/s; "
          "of roofline against them: " + ", ".join(f"{f:.2f}" for f in strict))
    w1 = None
    if args.w1 > 0:
        burst = Burst(requests=args.w1)
        before = machine()
        e = burst_time(engine, burst)
        after = machine()
        gemm, bandwidth, _ = (max(b, a) for b, a in zip(before, after, strict=True))
        prefill, decode = burst_roofline(engine, burst, gemm, bandwidth)
        w1 = {"requests": burst.requests, "prompt": burst.prompt, "output": burst.output, "engine_s": e,
              "roofline_prefill_s": prefill, "roofline_decode_s": decode, "gemm_flops_s": gemm,
              "read_bytes_s": bandwidth, "policy": engine.config.policy}
        print(f"W1 offline ({burst.requests} prompts of {burst.prompt} tokens, {burst.output} out, "
              f"{engine.config.policy}): {e:.2f} s, {burst.requests / e:.2f} req/s; roofline {prefill + decode:.2f} s "
              f"(prefill {prefill:.2f} + decode {decode:.2f}): {(prefill + decode) / e:.2f} of it", flush=True)
    if args.json:
        write_json(args.json, {
            "model": loaded.name, "dtype": str(dtype).removeprefix("torch."), "threads": args.threads,
            "cpu": cpu_name(), "attention": engine.runner.backend.name, "linears": engine.runner.cpu_linear,
            "repeats": args.repeats, "best_gemm_flops_s": best["gemm"], "best_read_bytes_s": best["bandwidth"],
            "deterministic": engine.runner.deterministic, "cases": cases, "w1": w1})


def profile(engine: Engine, context: int, repeats: int, batch: int = 32, prefill_tokens: int = 256) -> None:
    """Print the ops that take the time of a decode step and of a prefill (self CPU time)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    def table(title: str, run) -> None:
        run()  # warm
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                run()
        events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        total = sum(e.self_cpu_time_total for e in events)
        print(f"\n{title}: {total / repeats / 1e3:.1f} ms a step (self CPU time, {repeats} steps)")
        print(f"{'op':<44}{'ms/step':>9}{'share':>8}{'calls/step':>12}")
        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]:
            print(f"{e.key[:43]:<44}{e.self_cpu_time_total / repeats / 1e3:>9.1f}{e.self_cpu_time_total / total:>8.0%}"
                  f"{e.count / repeats:>12.0f}")

    params = SamplingParams(temperature=0.0, max_tokens=4 * repeats + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"prof-{i}", [1 + (i * 7 + j) % 1000 for j in range(context)], params)
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    table(f"decode step, batch {batch}, context {context}", engine.step)
    engine.abort([f"prof-{i}" for i in range(batch)])
    count = iter(range(10**6))

    def prefill() -> None:
        engine.add_request(f"prof-p{next(count)}", [1 + j % 5000 for j in range(prefill_tokens)],
                           SamplingParams(temperature=0.0, max_tokens=1))
        engine.step()

    table(f"prefill, {prefill_tokens} tokens", prefill)


def _token_counts(text: str) -> tuple[int, ...]:
    counts = tuple(int(x) for x in text.split(",") if x.strip())
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive token counts such as 64,256, got {text!r}")
    return counts


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "unknown")
    isa = [f for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2") if f" {f}" in info]
    return f"{name} ({', '.join(isa[:1] or ['no AVX2'])})"


if __name__ == "__main__":
    main()
