"""Running one worker process: build its configs from the command line, load, loop until drained."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.config.engine import ConfigError, EngineConfig, engine_config
from pdserve.config.worker import WorkerOptions, worker_options
from pdserve.text.model_files import ModelLoadError

if TYPE_CHECKING:
    from pdserve.worker.loop import Worker

log = logging.getLogger(__name__)

WorkerFactory = Callable[[WorkerOptions, EngineConfig], "Worker"]


def serve(factory: WorkerFactory, args: argparse.Namespace, policy: str | None = None) -> int:
    """Start the worker `factory` builds from `args`, run its loop until drained; the exit code."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        options = worker_options(args)  # refuses to run without a secret unless --insecure
        worker = factory(options, engine_config(args, policy))
    except (ConfigError, ModelLoadError) as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    worker.install_signal_handlers()
    worker.start()
    worker.run()
    log.info("worker %s stopped", worker.worker_id)
    return 0
