"""Running one worker process: build its configs from the command line, load, loop until drained."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.config.engine import ConfigError, EngineConfig, engine_config
from pdserve.config.tracing import tracing_options
from pdserve.config.worker import WorkerOptions, worker_options
from pdserve.telemetry import tracing
from pdserve.text.model_files import ModelLoadError

if TYPE_CHECKING:
    from pdserve.worker.loop import Worker

log = logging.getLogger(__name__)

WorkerFactory = Callable[[WorkerOptions, EngineConfig], "Worker"]


def serve(factory: WorkerFactory, args: argparse.Namespace, policy: str | None = None) -> int:
    """Start the worker `factory` builds from `args`, run its loop until drained; the exit code."""
    import torch

    from pdserve.engine.pipeline import PipelineBroken
    from pdserve.worker.warmup import use_triton_cache, warm_kernels  # a worker's imports

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        options = worker_options(args)  # refuses to run without a secret unless --insecure
        traces = tracing_options(args)
        config = engine_config(args, policy)
        use_triton_cache(config)
        worker = factory(options, config)
    except (ConfigError, ModelLoadError) as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    warm_kernels(worker.engine)  # before start(): registered and ready only once nothing compiles
    try:
        tracing.setup(f"pdserve-{worker.role}", worker.worker_id, otlp_endpoint=traces.traces_url,
                      trace_file=traces.trace_file)
    except OSError as exc:
        print(f"pdserve: --trace-file {traces.trace_file}: {exc.strerror}", file=sys.stderr)
        return 2
    worker.install_signal_handlers()
    worker.start()
    try:
        worker.run()
    except PipelineBroken as exc:
        print(f"pdserve: {worker.worker_id}: {exc}", file=sys.stderr)
        return 1
    finally:
        tracing.shutdown()  # the last spans out before the process goes
    log.info("worker %s stopped", worker.worker_id)
    return 0
