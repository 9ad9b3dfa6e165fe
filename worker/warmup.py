"""A worker's kernels, ready before the worker is: nothing compiles while it serves.

On CUDA, every Triton kernel variant the engine's configuration can reach is compiled (and run
once) before the worker registers and reports ready (kernels/triton_warmup.py), into the Triton
cache that --triton-cache names (the Kubernetes GPU overlay mounts a volume there, so a restarted
container finds its kernels compiled). On the CPU the same rule already holds by construction:
the compiled CPU kernels are loaded, or built for this machine, when the engine is built
(kernels/backends.py get_backend, in ModelRunner.__init__), which is before the worker starts.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pdserve.config import envs
from pdserve.config.engine import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.runner import ModelRunner
from pdserve.kernels.triton_backend import TritonBackend
from pdserve.kernels.triton_warmup import KernelShapes, Variant, warm_up

log = logging.getLogger(__name__)


def use_triton_cache(config: EngineConfig) -> None:
    """Point Triton at --triton-cache (created if need be) for this process and its children;
    before anything compiles."""
    if config.triton_cache:
        Path(config.triton_cache).mkdir(parents=True, exist_ok=True)
        envs.set_in_this_process("TRITON_CACHE_DIR", config.triton_cache)


def kernel_shapes(engine: Engine, runner: ModelRunner) -> KernelShapes:
    """What fixes the engine's Triton variants: its model, dtype, block size and limits."""
    m, config = engine.model_config, engine.config
    backend = runner.backend
    widest = -(-engine.max_model_len // config.block_size)
    return KernelShapes(
        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size, dtype=runner.dtype, block_size=config.block_size,
        max_num_seqs=config.max_num_seqs, token_budget=engine.scheduler.config.max_num_batched_tokens,
        max_blocks_per_seq=min(widest, engine.pool.num_blocks),
        windows=tuple(sorted({m.window(layer) for layer in range(m.num_layers)})),
        qk_norm=m.qk_norm, silu=m.hidden_act == "silu", attention=isinstance(backend, TritonBackend),
        fused_ops=runner.fused_elementwise,
        decode_splits=backend.decode_splits if isinstance(backend, TritonBackend) else None,
    )


def warm_kernels(engine: Engine) -> list[Variant]:
    """Compile what the engine's steps will launch; the variants run (none off CUDA)."""
    runner = engine.runner
    if not isinstance(runner, ModelRunner) or runner.device.type != "cuda":
        return []  # the CPU's compiled kernels were loaded with the engine (see the module docstring)
    backend = runner.backend if isinstance(runner.backend, TritonBackend) else None
    return warm_up(kernel_shapes(engine, runner), runner.device, backend)
