"""One decode step under torch.profiler: its trace, and how many kernels it launches.

    python -m pdserve.bench.decode_profile --model DIR --device cuda --dtype bfloat16 \\
        [--batch 64] [--context 256] [--trace PATH] [--json PATH]

The engine is built as a worker builds it (its device made current, every Triton variant warmed
first), `--batch` requests of `--context` prompt tokens are prefilled, and decode steps run until
the batch is steady; then the median of a few unprofiled steps is timed and one step is profiled
with the CPU and CUDA activities. Printed: the step's time, the GPU kernels it ran and their time
on the device, and the kernel launches the host made (each costs the host a few microseconds,
which at a small model's step sets its speed: docs/gpu.md, "Speed: launch-bound"). The Chrome
trace goes to --trace (open it in Perfetto). The engine's flags are `pdserve generate`'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.config.engine import add_engine_arguments, engine_config

LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
TIMED_STEPS = 5


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.decode_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(p)
    p.add_argument("--batch", type=int, default=64, help="requests decoding together (default 64)")
    p.add_argument("--context", type=int, default=256, help="prompt tokens of each (default 256)")
    p.add_argument("--trace", type=Path, help="write the profiled step's Chrome trace here")
    p.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    if args.batch < 1 or args.context < 1:
        p.error("--batch and --context must be at least 1")
    return args


def _device_time_us(event: Any) -> float:
    """An event's own time on the device (the attribute's name changed across torch versions)."""
    for name in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def profile_step(engine: Any, trace: Path | None) -> dict[str, float]:
    """Profile one engine step; what it ran on the device and launched from the host."""
    import torch
    from torch.profiler import DeviceType, ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        engine.step()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    events = list(prof.events() or ())
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    launches = [e for e in events if e.name in LAUNCH_CALLS]
    return {"profiled_step_ms": wall * 1e3, "kernels": len(kernels), "launch_calls": len(launches),
            "kernel_time_ms": sum(_device_time_us(e) for e in kernels) / 1e3}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from pdserve.engine.device import select_device
    from pdserve.engine.engine import Engine
    from pdserve.protocol.sampling import SamplingParams
    from pdserve.worker.warmup import warm_kernels

    config = engine_config(args)
    select_device(config.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(config)
    warmed = warm_kernels(engine)
    # Room for the tokens the first requests decode while the last ones still prefill.
    prefill_steps = -(-args.batch * args.context // engine.scheduler.config.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=prefill_steps + TIMED_STEPS + 16, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"decode-{i}", [1 + (i * 7 + j) % 1000 for j in range(args.context)], params)
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):  # steady: every request decoding
        engine.step()
    if len(engine.scheduler.running) != args.batch:
        raise SystemExit(f"the batch is {len(engine.scheduler.running)} requests, not {args.batch}: "
                         "raise --max-num-seqs or the KV cache")
    times = []
    for _ in range(TIMED_STEPS):
        start = time.perf_counter()
        engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    figures = {"batch": args.batch, "context": args.context, "device": config.device,
               "dtype": str(engine.runner.dtype).removeprefix("torch."), "warmed_variants": len(warmed),
               "step_ms": statistics.median(times) * 1e3, **profile_step(engine, args.trace)}
    print(f"decode step, batch {args.batch}, context {args.context}, {figures['dtype']} on {config.device}: "
          f"{figures['step_ms']:.2f} ms (median of {TIMED_STEPS}); profiled: {figures['profiled_step_ms']:.2f} ms, "
          f"{figures['kernels']} kernels taking {figures['kernel_time_ms']:.2f} ms on the device, "
          f"{figures['launch_calls']} launch calls from the host")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
