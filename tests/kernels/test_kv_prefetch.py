"""The compiled layers' KV prefetch (kernels/csrc/cpu_decoder_layer.cpp) is an argument of
decoder_layers_, on by default, that model/llama.py passes from use_compiled_layers(kv_prefetch=):
off or on, a decode batch large enough to prefetch gives the same tokens and cache bits."""

from __future__ import annotations

import torch

from pdserve.config.engine import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.kernels import linear as linear_module
from tests.helpers.engine_runs import greedy_tokens


def test_the_op_takes_kv_prefetch_on_by_default(ops):
    (arg,) = [a for a in ops.decoder_layers_.default._schema.arguments if a.name == "kv_prefetch"]
    assert str(arg.type) == "bool" and arg.default_value is True


def test_a_decode_batch_gives_the_same_tokens_and_cache_with_the_kv_prefetch_off(tiny, monkeypatch):
    """20 sequences decoding together: steps of 16 rows or more, where the MLP prefetches the next
    layer's KV on the VDPBF16PS tiles (elsewhere the switch changes nothing, and still must not)."""
    monkeypatch.setattr(linear_module, "tiles_run", lambda ops: ops is not None)
    prompts = {f"s{i}": [5 + i, 11, 40 + 3 * i] + list(range(60, 60 + 2 * i)) for i in range(20)}
    engines = [Engine(EngineConfig(model="tiny", num_kv_blocks=128, dtype="bfloat16"), loaded=tiny) for _ in range(2)]
    compiled = [e.runner.model.compiled_layers for e in engines]
    assert compiled[0] is not None and compiled[0].kv_prefetch, "on unless the caller turns it off"
    engines[1].runner.model.use_compiled_layers(compiled[1].ops, kv_prefetch=False)
    assert engines[1].runner.model.compiled_layers.kv_prefetch is False
    outs = [greedy_tokens(e, prompts, 6) for e in engines]
    assert all(len(v) == 6 for v in outs[0].values())
    assert outs[0] == outs[1]
    torch.testing.assert_close(engines[0].runner.kv_cache, engines[1].runner.kv_cache, atol=0, rtol=0)
