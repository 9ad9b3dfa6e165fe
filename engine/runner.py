"""Packs a scheduled step into flat tensors, runs the model once, samples.

Packed order:  [ single-token sequences (decodes) | multi-token chunks (prefills) ]
Per token:     input_ids, positions, slot_mapping (= block_ids[pos // S] * S + pos % S)
Per sequence:  seq_lens (computed + new), block_tables, cu_seqlens_q (prefill part)
Only the rows of sequences that finish their known tokens this step reach the LM head.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from pdserve.config.engine import EngineConfig
from pdserve.engine.device import HostPart, StepUploader, select_device
from pdserve.engine.host_memory import keep_step_memory
from pdserve.engine.kv_cache import BlockIds, gather_blocks, scatter_blocks
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler, SampleResult
from pdserve.engine.scheduler import ScheduledRequest
from pdserve.kernels.backends import get_backend
from pdserve.kernels.cpu_backend import COMPILED_DTYPES, CpuBackend
from pdserve.kernels.huge_pages import fault_in_background, zeros_on_huge_pages
from pdserve.kernels.linear import (
    TileLinear,
    linears_fit_tiles,
    select_linear_method,
    use_linear_method,
)
from pdserve.model.attention_metadata import AttentionMetadata
from pdserve.model.config import ModelConfig, resolve_dtype, torch_dtype
from pdserve.model.llama import LlamaForCausalLM, StageLayers


def _tensor(values: array, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor over an array.array's memory (no copy; the tensor keeps the array alive)."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(values, dtype=dtype)


@dataclass(slots=True)
class PackedStep:
    """A step's inputs on the host: per token, per sequence (tables: one row of `width` block
    ids per sequence), the number of rows that attend as decodes, and the rows that sample."""

    input_ids: array
    positions: array
    slots: array
    seq_lens: array
    cu: array
    tables: array
    width: int
    num_decode_rows: int
    sample_rows: array
    samplers: list[Request]
    device_rows: torch.Tensor | None = None  # sample_rows on the device, once forward() uploaded them

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


class ModelRunner:
    """Owns the model weights and the KV cache tensor [L, 2, num_blocks, S, Hkv, D]."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, state_dict, max_model_len: int, num_blocks: int,
                 consume_weights: bool = False, stage: StageLayers | None = None) -> None:
        self.device = select_device(config.device)  # cuda:N: the current device is N from here on
        self.uploader = StepUploader(self.device)
        if self.device.type == "cpu":
            keep_step_memory()
        self.dtype = torch_dtype(resolve_dtype(config.dtype, config.device))
        self.block_size = config.block_size
        self.config = config
        self.backend = get_backend(self.device, config.attention_backend, cpu_kernels=config.cpu_kernels,
                                   require_cpu_kernels=config.require_cpu_kernels, kernel_cache=config.kernel_cache)
        # A pipeline stage (engine/pipeline.py) holds its layers, their KV cache and their weights only.
        self.stage = stage or StageLayers.whole(model_config.num_layers)
        self.model = LlamaForCausalLM(model_config, self.backend, max_positions=max_model_len, stage=self.stage)
        # The parameters take the serving dtype and device first, the weights are cast as they are
        # copied in: no float32 copy of the model beside the source. With `consume_weights` the
        # source (a worker's own, LoadedModel.single_use) is let go tensor by tensor as well.
        self.model.to(device=self.device, dtype=self.dtype).eval()
        self.model.load_weights(state_dict, consume=consume_weights)
        for rotary in (self.model.model.rotary, self.model.model.rotary_local):  # tables stay float32
            if rotary is not None:
                rotary.to(dtype=torch.float32)
        # torch.ops.pdserve_cpu where the compiled CPU backend runs and this dtype is one it computes.
        self.compiled_ops = (
            self.backend.ops if isinstance(self.backend, CpuBackend) and self.dtype in COMPILED_DTYPES else None
        )
        fit_tiles = linears_fit_tiles(self.model)
        self.deterministic = self._deterministic(fit_tiles)
        self.cpu_linear = self._pack_cpu_linears(fit_tiles) if self.device.type == "cpu" else "none"
        fused_ops = self._fused_elementwise_ops()
        self.fused_elementwise = fused_ops is not None
        if fused_ops is not None:
            self.model.use_fused_ops(fused_ops)
        # Steps run every layer in one compiled call where every piece of it is compiled: decode-only
        # steps, and steps with prompts where the backend's prefill attention is compiled too.
        if self.fused_elementwise and self.cpu_linear in ("tiles", "pdserve", "onednn"):
            self.model.use_compiled_layers(self.compiled_ops, kv_prefetch=config.kv_prefetch)
        if self.deterministic and not self.compiled_layers:
            raise ValueError("--deterministic runs each step's layers in the compiled CPU kernels; they do not "
                             "run here (--cpu-kernels off, --no-fused-ops, another device, or a dtype or "
                             "activation they lack)")
        m = model_config
        shape = (self.stage.end - self.stage.start, 2, num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        self.kv_cache = (
            zeros_on_huge_pages(shape, self.dtype) if self.device.type == "cpu"
            else torch.zeros(shape, dtype=self.dtype, device=self.device)
        )
        # Its pages fault in on a background thread, lowest blocks first (None: nothing to do).
        self.kv_fault_in = fault_in_background(self.kv_cache) if self.device.type == "cpu" else None
        self.sampler = Sampler(ops=self.compiled_ops)

    def _deterministic(self, fit_tiles: bool) -> bool:
        """--deterministic resolved: on where asked (the checks after packing refuse what cannot
        hold), off where refused, and unset, on where it costs little: bfloat16 on the tile kernels,
        whose decode steps it leaves as they were and whose long prompts it slows by a few per cent
        (python -m pdserve.bench.engine_overhead --deterministic against --no-deterministic;
        docs/cpu_kernels.md "Batch invariance"). Off for float32 (its prompts' attention through
        the decode kernel costs more) and wherever the compiled layers do not run every step."""
        asked = self.config.deterministic
        if asked is not None:
            return asked
        return (self.config.fused_ops and self.config.cpu_linear in ("auto", "tiles", "amx") and fit_tiles
                and TileLinear.supports(self.dtype, self.device, self.compiled_ops) and self.model.compiles_layers)

    def _fused_elementwise_ops(self) -> object | None:
        """What runs RMSNorm, SiLU-mul and rotary: the compiled CPU ops, which ship with the
        compiled attention (kernels/csrc); on CUDA one Triton launch each instead of eager's
        several; None where eager PyTorch runs them (or --no-fused-ops asks for it)."""
        if not self.config.fused_ops:
            return None
        if self.compiled_ops is not None:
            return self.compiled_ops
        if self.device.type == "cuda":
            from pdserve.kernels.triton_elementwise import TritonElementwise

            return TritonElementwise()
        return None

    @property
    def compiled_layers(self) -> bool:
        """Whether steps run every layer in one compiled call (model.compiled_layers)."""
        return self.model.compiled_layers is not None

    @property
    def kv_cache_resident(self) -> bool:
        """Whether the KV cache's pages are all in (its fault-in thread is done, or there is none):
        before that, a step's first writes to a page pay for faulting it in."""
        return self.kv_fault_in is None or not self.kv_fault_in.is_alive()

    def _pack_cpu_linears(self, fit_tiles: bool) -> str:
        """Pick the CPU matmul once, at load (--cpu-linear; kernels.linear.select_linear_method
        holds `auto`'s rule and the fallbacks), and pack every projection for it. Returns the
        --cpu-linear name of what runs: tiles, pdserve, onednn or mkl."""
        ops = self.compiled_ops
        method = select_linear_method(self.config.cpu_linear, self.dtype, self.device, ops,
                                      weights_fit_tiles=fit_tiles,
                                      batch_invariant=self.deterministic)
        use_linear_method(self.model, method)
        return method.cpu_linear

    def read_blocks(self, block_ids: BlockIds, out: torch.Tensor | None = None) -> torch.Tensor:
        """A contiguous copy of these blocks, [L, 2, n, S, Hkv, D] (what a KV save ships), in
        `out` when given."""
        return gather_blocks(self.kv_cache, block_ids, out)

    def write_blocks(self, block_ids: BlockIds, payload: torch.Tensor) -> None:
        """Copy payload block i into block `block_ids[i]` (a KV load); KVPayloadError if it does not fit."""
        scatter_blocks(self.kv_cache, block_ids, payload)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> tuple[list[Request], SampleResult | None]:
        """Run one step; return the requests that sampled, in order, and their samples."""
        step = self.pack(scheduled)
        hidden = self.forward(step)
        return self.sample(step, hidden)

    def pack(self, scheduled: list[ScheduledRequest]) -> PackedStep:
        """A step's host-side inputs, in the packed order (the module's docstring)."""
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        ordered = decodes + prefills
        bs = self.block_size
        # Host-side step data as array.array, not lists: torch.tensor converts a list at about
        # 75 ns an element, array.array at about a third of that, and torch.frombuffer shares it.
        input_ids, positions, slots = array("q"), array("q"), array("q")
        seq_lens, cu, sample_rows = array("i"), array("i", [0]), array("q")
        tables: list[list[int]] = []
        samplers: list[Request] = []
        # --deterministic: every token attends as a decode does, one row against its own prefix
        # through the decode kernel, so its attention is the same arithmetic in a prefill chunk as
        # in a decode step (the compiled layers and the batch-invariant projections do the rest).
        as_decodes = self.deterministic
        for req, n in ordered:
            start = req.num_computed_tokens
            end = start + n
            blocks = req.block_ids
            if n == 1:  # a decode: one token, no slices or generators
                input_ids.append(req.token_ids[start])
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
                seq_lens.append(end)
                tables.append(blocks)
            else:
                input_ids.extend(req.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
                if as_decodes:  # row p: a sequence of p + 1 tokens over the prompt's blocks
                    seq_lens.extend(range(start + 1, end + 1))
                    tables.extend([blocks] * n)
                else:
                    seq_lens.append(end)
                    tables.append(blocks)
                    cu.append(cu[-1] + n)
            if end == req.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                samplers.append(req)
        nd = len(input_ids) if as_decodes else len(decodes)
        width = max(len(t) for t in tables)
        flat = array("i")
        for t in tables:  # each row padded with block 0 (never read past the sequence's length)
            flat.extend(t)
            flat.frombytes(bytes(flat.itemsize * (width - len(t))))
        return PackedStep(input_ids, positions, slots, seq_lens, cu, flat, width, nd, sample_rows, samplers)

    @torch.inference_mode()
    def forward(self, step: PackedStep, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run this runner's layers over a packed step: from the token ids (the first stage), or
        from `hidden`, the previous stage's residual stream. Returns the final hidden states (the
        last stage), else this stage's residual stream."""
        table = _tensor(step.tables, torch.int32).view(-1, step.width) if step.width else torch.empty(0, 0, dtype=torch.int32)
        lens = _tensor(step.seq_lens, torch.int32)
        nd = step.num_decode_rows
        # One upload (on CUDA: one pinned buffer, one non-blocking copy; on the CPU: views).
        ids, positions, slots, dlens, plens, dtab, ptab, cu, rows = self.uploader.upload([
            HostPart(step.input_ids if hidden is None else array("q"), torch.int64),
            HostPart(step.positions, torch.int64), HostPart(step.slots, torch.int64),
            HostPart(lens[:nd], torch.int32), HostPart(lens[nd:], torch.int32),
            HostPart(table[:nd], torch.int32), HostPart(table[nd:], torch.int32),
            HostPart(step.cu, torch.int32), HostPart(step.sample_rows, torch.int64),
        ])
        step.device_rows = rows
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decode_tokens=nd,
            decode_seq_lens=dlens,
            decode_block_tables=dtab,
            prefill_cu_seqlens_q=cu,
            prefill_seq_lens=plens,
            prefill_block_tables=ptab,
        )
        return self.model(ids if hidden is None else None, positions, meta, self.kv_cache, hidden=hidden)

    @torch.inference_mode()
    def sample(self, step: PackedStep, hidden: torch.Tensor, rows_only: bool = False) -> tuple[list[Request], SampleResult | None]:
        """The LM head and the sampler over the rows that sample. `hidden` holds every row of the
        step, or with `rows_only` just the sampling rows (what the last pipeline stage sends)."""
        samplers, sample_rows = step.samplers, step.sample_rows
        if not samplers:
            return [], None
        # Every row samples in a decode-only step (rows ascend, so they are all of them in order):
        # no gather, whose code and data would come from DRAM right after the layers have streamed
        # every weight through the caches.
        if rows_only or len(sample_rows) == hidden.shape[0]:
            rows = hidden
        else:
            index = step.device_rows if step.device_rows is not None else _tensor(sample_rows, torch.long).to(self.device)
            rows = hidden[index]
        logits = self.model.compute_logits(rows)
        return samplers, self.sampler(logits, samplers)
