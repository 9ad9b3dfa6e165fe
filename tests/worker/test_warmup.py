"""worker/warmup.py and worker/serve.py: a worker's kernels are ready before it starts (registers
and reports ready); the Triton variants come from the engine's own configuration."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.config import envs
from pdserve.config.engine import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.kernels import cpu_ops
from pdserve.kernels.cpu_backend import CpuBackend
from pdserve.worker.serve import serve
from pdserve.worker.warmup import kernel_shapes, use_triton_cache, warm_kernels


class FakeWorker:
    """What serve() drives, around a real engine; records when it starts."""

    role, worker_id = "prefill", "prefill-test"

    def __init__(self, engine: Engine, events: list[str]) -> None:
        self.engine, self.events = engine, events

    def install_signal_handlers(self) -> None:
        pass

    def start(self) -> FakeWorker:
        self.events.append("start")
        return self

    def run(self) -> None:
        self.events.append("run")


def test_the_cpu_kernels_are_loaded_before_the_worker_starts(tiny, tiny_dir, monkeypatch):
    events: list[str] = []
    real_load = cpu_ops.load

    def load(*args, **kwargs):
        ops = real_load(*args, **kwargs)
        events.append("cpu kernels" if ops is not None else "no cpu kernels")
        return ops

    monkeypatch.setattr(cpu_ops, "load", load)
    engines: list[Engine] = []

    def factory(options, config):
        engines.append(Engine(config, loaded=tiny))
        return FakeWorker(engines[0], events)

    args = build_parser().parse_args(["prefill", "--insecure", "--model", str(tiny_dir), "--kv-cache-memory-gb", "0.01"])
    assert serve(factory, args) == 0
    assert events == ["cpu kernels", "start", "run"]
    assert isinstance(engines[0].runner.backend, CpuBackend)


def test_off_cuda_there_is_nothing_to_compile(tiny):
    assert warm_kernels(Engine(EngineConfig(num_kv_blocks=8), loaded=tiny)) == []


def test_the_variants_come_from_the_engines_model_and_limits(tiny):
    engine = Engine(EngineConfig(num_kv_blocks=6, max_num_seqs=3, max_num_batched_tokens=40, max_model_len=512,
                                 attention_backend="triton"), loaded=tiny)
    s = kernel_shapes(engine, engine.runner)
    m = tiny.config
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.hidden_size) == (m.num_heads, m.num_kv_heads, m.head_dim,
                                                                         m.hidden_size)
    assert (s.max_num_seqs, s.token_budget, s.block_size) == (3, 40, 16)
    assert s.max_blocks_per_seq == 6  # the cache, not the context (32 blocks), bounds a sequence
    assert s.attention and s.windows == (0,) and s.silu and not s.qk_norm


def test_the_triton_cache_flag_points_triton_at_its_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    folder = tmp_path / "triton"
    use_triton_cache(EngineConfig(triton_cache=str(folder)))
    assert folder.is_dir() and envs.get("TRITON_CACHE_DIR") == str(folder)


def test_without_the_flag_tritons_own_cache_is_left_alone(monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    use_triton_cache(EngineConfig())
    assert envs.get("TRITON_CACHE_DIR") is None


@pytest.mark.parametrize("argv, want", [([], None), (["--triton-cache", "/cache/triton"], "/cache/triton")])
def test_the_triton_cache_is_an_engine_flag(argv, want):
    from pdserve.config.engine import engine_argv, engine_config

    config = engine_config(build_parser().parse_args(["prefill", *argv]))
    assert config.triton_cache == want
    assert ("--triton-cache" in engine_argv(config)) == (want is not None)
