"""How a projection runs: one LinearMethod per way of computing x W^T + b, picked once at load.

A `Linear` holds its weight and bias; its `method` owns everything else: the packed copies it
makes of the weight (kept in `layer.copies` under the method's own keys), how a step runs
through them, the fused act-mul of a gate/up projection where a kernel applies it, and which copy
the compiled decoder layers read (ops.h `project` tells the layouts apart by rank):

| method         | --cpu-linear | copies            | compiled layers read       | where it runs          |
|----------------|--------------|-------------------|----------------------------|------------------------|
| `plain`        | mkl          | none              | nothing (eager layers)     | CPU (MKL), CUDA        |
| `onednn`       | onednn       | oneDNN's layout   | the oneDNN copy (2-D)      | CPUs whose oneDNN runs |
| `panels`       | pdserve      | 24-column panels  | the panels (3-D)           | with the compiled ops  |
| `tiles`        | tiles        | bfloat16 tiles    | the tiles (5-D)            | AMX or AVX512-BF16     |
| `tiles+onednn` | tiles        | tiles and oneDNN  | the tiles; oneDNN's above  | both of the above      |
|                |              |                   | TILE_MAX_ROWS rows         |                        |

`select_linear_method` decides (the rule of --cpu-linear's `auto` and its fallbacks), and
`use_linear_method` packs a whole model. docs/cpu_kernels.md, "Projections", says why each exists.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Set
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import cpu_linear
from pdserve.kernels.cpu_linear import tile_kernel, tiles_run
from pdserve.kernels.huge_pages import copies_on_huge_pages, huge_page_share
from pdserve.kernels.variants import cpu_flags

log = logging.getLogger(__name__)

# The --cpu-linear choices (config/names.py's CPU_LINEARS; config and kernels import neither).
CHOICES = ("auto", "tiles", "amx", "pdserve", "onednn", "mkl")
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda gate: F.gelu(gate, approximate="tanh")}
# The share of the packed weights' mapping on huge pages from which the tile kernels count them as
# there (the mapping's tail past its last whole huge page never is).
HUGE_PAGE_SHARE = 0.9


def onednn_linear_available(dtype: torch.dtype) -> bool:
    """Whether this torch can run packed oneDNN linears in `dtype` on this CPU."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def act_mul(gate_up: torch.Tensor, act: str, elementwise: object | None = None) -> torch.Tensor:
    """act(gate) * up of [..., 2I] (the gate's I columns first) -> [..., I]: through
    `elementwise.silu_mul` / `gelu_tanh_mul` where given and it has one (the compiled CPU ops have
    both, Triton's SiLU), else eager PyTorch."""
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r}: expected one of {', '.join(ACTIVATIONS)}")
    op = getattr(elementwise, f"{act}_mul", None) if elementwise is not None else None
    if op is not None:
        return op(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[act](gate) * up


class LinearMethod(ABC):
    """One way to run a Linear. One object serves every layer it packs; what is per layer (its
    copies of the weight) lives on the layer. pack() only adds copies: the weight, the bias and
    other methods' copies stay. apply() reads the weight, the bias and this method's copies."""

    name: ClassVar[str]  # the packing, as logs (and model/llama.py's pack_cpu_linears) name it
    cpu_linear: ClassVar[str]  # the --cpu-linear value that reports it (ModelRunner.cpu_linear)
    streamed: ClassVar[str | None] = None  # the copy a decode step streams whole: on huge pages

    def __init__(self, ops: object | None = None) -> None:
        self.ops = ops  # torch.ops.pdserve_cpu for the methods whose kernels are in it

    @classmethod
    @abstractmethod
    def supports(cls, weight_dtype: torch.dtype, device: torch.device, ops: object | None) -> bool:
        """Whether this method runs weights of this dtype on this device with these compiled ops."""

    def pack(self, layer: Linear) -> None:
        """Make this method's copies of `layer.weight` (none by default)."""

    @abstractmethod
    def product(self, layer: Linear, x: torch.Tensor, tile_order: bool = False) -> torch.Tensor:
        """x W^T without the bias, x [..., K] -> [..., N]."""

    def apply(self, layer: Linear, x: torch.Tensor, tile_order: bool = False) -> torch.Tensor:
        """x W^T + b, the bias added after the matmul in the output dtype. `tile_order`: a paired
        gate/up projection's columns as its tiles give them (the compiled layers' order); only the
        tile methods have another order."""
        y = self.product(layer, x, tile_order)
        return y if layer.bias is None else y.add_(layer.bias)

    def apply_act_mul(self, layer: Linear, x: torch.Tensor, intermediate: int, act: str = "silu",
                      elementwise: object | None = None) -> torch.Tensor:
        """act(gate) * up of a gate/up projection ([2I] columns, the gate's first) -> [..., I]:
        here apply, then act_mul through `elementwise` (see act_mul); the panel and tile methods
        fuse SiLU-mul into their kernel where they can."""
        _check_gate_up(layer, intermediate)
        return act_mul(self.apply(layer, x), act, elementwise)

    def compiled_weight(self, layer: Linear) -> torch.Tensor | None:
        """The copy the compiled decoder layers read (None: this method has none for them)."""
        return None

    def large_step_weight(self, layer: Linear) -> torch.Tensor | None:
        """The copy steps of more than cpu_linear.TILE_MAX_ROWS rows read instead, where there is
        one (oneDNN's beside the tiles), else None."""
        return None

    def place(self, layers: list[Linear]) -> None:
        """Once every layer is packed: the copies the kernels stream whole at every decode step
        go side by side into one huge-page mapping (oneDNN's are opaque tensors and stay)."""
        if self.streamed is None or not layers:
            return
        copies = copies_on_huge_pages([layer.copies[self.streamed] for layer in layers])
        for layer, copy in zip(layers, copies, strict=True):
            layer.copies[self.streamed] = copy

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _check_gate_up(layer: Linear, intermediate: int) -> None:
    if layer.out_features != 2 * intermediate:
        raise ValueError(f"a gate/up projection of intermediate size {intermediate} has {2 * intermediate} "
                         f"output features, this one {layer.out_features}")


def _needs_ops(ops: object | None, name: str) -> object:
    if ops is None:
        raise ValueError(f"the {name} linears run in the compiled CPU ops: load them first (kernels.cpu_ops.load)")
    return ops


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


class PlainLinear(LinearMethod):
    """x @ W^T on the plain weight: MKL on the CPU (against the transposed storage it runs small
    batches faster than F.linear), cuBLAS on CUDA."""

    name, cpu_linear = "plain", "mkl"

    @classmethod
    def supports(cls, weight_dtype, device, ops) -> bool:
        return True

    def product(self, layer, x, tile_order=False):
        return x @ layer.weight.t()


class OneDnnLinear(LinearMethod):
    """oneDNN's matmul on its own blocked copy of the weight: faster than MKL at decode sizes;
    `auto`'s choice for float32 on AVX-512 and for bfloat16 where the tiles cannot run."""

    name, cpu_linear = "onednn", "onednn"

    @classmethod
    def supports(cls, weight_dtype, device, ops) -> bool:
        return device.type == "cpu" and onednn_linear_available(weight_dtype)

    def pack(self, layer):
        layer.copies["onednn"] = _onednn_copy(layer)

    def product(self, layer, x, tile_order=False):
        return torch.ops.mkldnn._linear_pointwise(x, layer.copies["onednn"], None, "none", [], "")

    def compiled_weight(self, layer):
        return layer.copies["onednn"]


def _onednn_copy(layer: Linear, batch_hint: int = 64) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach().contiguous(), batch_hint)


class PanelLinear(LinearMethod):
    """The compiled panel kernel (kernels/csrc/cpu_linear.cpp) on 24-column panels, float32 or
    bfloat16: on AVX2 CPUs faster than oneDNN from 1 to 256 rows; SiLU-mul fused where the
    intermediate size is whole panels."""

    name, cpu_linear, streamed = "panels", "pdserve", "panels"

    def __init__(self, ops: object) -> None:
        super().__init__(_needs_ops(ops, self.name))

    @classmethod
    def supports(cls, weight_dtype, device, ops) -> bool:
        return device.type == "cpu" and ops is not None and weight_dtype in (torch.float32, torch.bfloat16)

    def pack(self, layer):
        layer.copies["panels"] = cpu_linear.pack_weight(layer.weight.detach())

    def product(self, layer, x, tile_order=False):
        return cpu_linear.linear(self.ops, x, layer.copies["panels"], layer.out_features)

    def apply_act_mul(self, layer, x, intermediate, act="silu", elementwise=None):
        _check_gate_up(layer, intermediate)
        if act == "silu" and layer.bias is None and cpu_linear.fuses_silu_mul(intermediate):
            return cpu_linear.linear_silu_mul(self.ops, x, layer.copies["panels"], intermediate)
        return super().apply_act_mul(layer, x, intermediate, act, elementwise)

    def compiled_weight(self, layer):
        return layer.copies["panels"]


class TileLinear(LinearMethod):
    """The bfloat16 tile kernel (kernels/csrc/cpu_linear_tiles.cpp) on AMX or VDPBF16PS: it
    streams decode steps' weights faster than oneDNN. A gate/up projection's tiles pair the two
    halves' groups (cpu_linear.pack_gate_up_tiles), as the fused SiLU-mul kernel reads them."""

    name, cpu_linear, streamed = "tiles", "tiles", "tiles"

    def __init__(self, ops: object) -> None:
        super().__init__(_needs_ops(ops, self.name))

    @classmethod
    def supports(cls, weight_dtype, device, ops) -> bool:
        return device.type == "cpu" and weight_dtype == torch.bfloat16 and tiles_run(ops)

    def pack(self, layer):
        weight = layer.weight.detach()
        paired = self.paired(layer)
        layer.copies["tiles"] = (cpu_linear.pack_gate_up_tiles(weight, layer.gate_up_of) if paired
                                 else cpu_linear.pack_tiles(weight))

    @staticmethod
    def paired(layer: Linear) -> bool:
        """Whether the layer's tiles pair the gate's and the up's groups."""
        return layer.gate_up_of > 0 and cpu_linear.tiles_fuse_silu_mul(layer.gate_up_of)

    def runs_tiles(self, x: torch.Tensor) -> bool:
        """Whether a step of these rows runs on the tiles (here always)."""
        return True

    def product(self, layer, x, tile_order=False):
        paired = self.paired(layer)
        if tile_order and paired and layer.bias is not None:
            raise ValueError("tile_order is for gate/up projections without a bias")
        y = cpu_linear.tile_linear(self.ops, x, layer.copies["tiles"], layer.out_features)
        return cpu_linear.unpair_gate_up(y, layer.gate_up_of) if paired and not tile_order else y

    def apply_act_mul(self, layer, x, intermediate, act="silu", elementwise=None):
        _check_gate_up(layer, intermediate)
        fused = act == "silu" and layer.bias is None and self.paired(layer) and layer.gate_up_of == intermediate
        if fused and self.runs_tiles(x):
            return cpu_linear.tile_linear_silu_mul(self.ops, x, layer.copies["tiles"], intermediate)
        return super().apply_act_mul(layer, x, intermediate, act, elementwise)

    def compiled_weight(self, layer):
        return layer.copies["tiles"]

    def place(self, layers):
        super().place(layers)
        # One mapping: where it is on huge pages, the smallest steps leave its stream to the hardware.
        on_huge = bool(layers) and huge_page_share(layers[0].copies["tiles"]) >= HUGE_PAGE_SHARE
        self.ops.set_tile_weights_on_huge_pages(on_huge)  # type: ignore[union-attr]


class TileOneDnnLinear(TileLinear):
    """The tiles for steps of up to cpu_linear.TILE_MAX_ROWS rows, oneDNN's copy (through the
    compiled op, which splits mid-sized steps' rows between threads) for larger ones, where it is
    faster."""

    name = "tiles+onednn"

    @classmethod
    def supports(cls, weight_dtype, device, ops) -> bool:
        return TileLinear.supports(weight_dtype, device, ops) and OneDnnLinear.supports(weight_dtype, device, ops)

    def pack(self, layer):
        super().pack(layer)
        layer.copies["onednn"] = _onednn_copy(layer)

    def runs_tiles(self, x):
        return _rows(x) <= cpu_linear.TILE_MAX_ROWS

    def product(self, layer, x, tile_order=False):
        if self.runs_tiles(x):
            return super().product(layer, x, tile_order)
        return self.ops.onednn_linear(x, layer.copies["onednn"])  # type: ignore[union-attr]

    def large_step_weight(self, layer):
        return layer.copies["onednn"]


PLAIN = PlainLinear()


class Linear(nn.Module):
    """y = x W^T + b, W [out, in] stored transposed ([in, out] contiguous: see PlainLinear), run
    by `method` (PLAIN until use_linear_method packs it for another). `gate_up_of`: a gate/up
    projection's intermediate size (0 for any other), which the tile methods pair by."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, gate_up_of: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features).t())
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features))
        else:
            self.register_parameter("bias", None)
        self.in_features, self.out_features, self.gate_up_of = in_features, out_features, gate_up_of
        self.method: LinearMethod = PLAIN
        self.copies: dict[str, torch.Tensor] = {}  # the method's packed copies of the weight, by its keys

    def forward(self, x: torch.Tensor, tile_order: bool = False) -> torch.Tensor:
        return self.method.apply(self, x, tile_order)

    @property
    def compiled_weight(self) -> torch.Tensor | None:
        """The packed copy the compiled decoder layers read (LinearMethod.compiled_weight)."""
        return self.method.compiled_weight(self)

    @property
    def large_step_weight(self) -> torch.Tensor | None:
        """The copy steps of more than TILE_MAX_ROWS rows read instead, where the method keeps
        one (LinearMethod.large_step_weight)."""
        return self.method.large_step_weight(self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, method={self.method.name}")


def linears_fit_tiles(model: nn.Module) -> bool:
    """Whether every Linear of the model can be packed into tiles (bfloat16, K a multiple of 32)."""
    return all(cpu_linear.tiles_fit(m.weight) for m in model.modules() if isinstance(m, Linear))


def select_linear_method(choice: str, dtype: torch.dtype, device: torch.device, ops: object | None,
                         weights_fit_tiles: bool, flags: Set[str] | None = None,
                         batch_invariant: bool = False) -> LinearMethod:
    """The method a model's Linears run, for --cpu-linear's `choice` (off the CPU: plain). `auto`
    takes the tiles for bfloat16 where they run natively, on AMX or AVX512-BF16, and every
    weight fits them (they read decode steps' weights faster than oneDNN); else oneDNN on CPUs with
    AVX-512 (512-bit kernels, where the panels are 8 wide) and for bfloat16 wherever oneDNN
    computes it; the panels elsewhere (AVX2) where the compiled ops loaded. A choice this machine
    cannot run falls back in that order, to plain last. `flags`: the CPU's (/proc/cpuinfo), this
    one's by default. `python -m pdserve.bench.engine_overhead --cpu-linear <choice>` measures
    each against the default (docs/cpu_kernels.md, "Projections"). `batch_invariant`: only a
    method whose every output row is the same whatever the other rows (batch_invariant_method)."""
    if choice not in CHOICES:
        raise ValueError(f"--cpu-linear must be one of {', '.join(CHOICES)}, got {choice!r}")
    tiles = device.type == "cpu" and TileLinear.supports(dtype, device, ops) and weights_fit_tiles
    if batch_invariant:
        return batch_invariant_method(choice, dtype, device, ops, tiles)
    if device.type != "cpu":
        return PLAIN
    onednn = OneDnnLinear.supports(dtype, device, ops)
    if choice == "auto":
        avx512 = "avx512f" in (cpu_flags() if flags is None else flags)
        prefer_onednn = dtype == torch.bfloat16 or avx512
        choice = "tiles" if tiles else "onednn" if (onednn and prefer_onednn) or ops is None else "pdserve"
    if choice in ("tiles", "amx"):
        if tiles:  # and oneDNN's copy for the larger steps, where it is faster (cpu_linear.TILE_MAX_ROWS)
            log.info("CPU linears: bfloat16 tiles on %s", tile_kernel(ops))
            return TileOneDnnLinear(ops) if onednn else TileLinear(ops)
        log.warning("--cpu-linear=%s: this CPU, dtype or model cannot run the tile kernel natively (%s); "
                    "falling back", choice, tile_kernel(ops))
        choice = "pdserve"
    if choice == "pdserve" and PanelLinear.supports(dtype, device, ops):
        return PanelLinear(ops)
    if choice in ("pdserve", "onednn") and onednn:
        return OneDnnLinear()
    return PLAIN


def batch_invariant_method(choice: str, dtype: torch.dtype, device: torch.device, ops: object | None,
                           tiles: bool) -> LinearMethod:
    """A method whose output row i depends on row i of x alone, bit for bit, at every row count:
    the tiles (one kernel at every size: no oneDNN copy above TILE_MAX_ROWS) or the panels, each of
    which sums a row's products over K in one fixed order whatever the rows beside it (oneDNN, MKL
    and cuBLAS pick their kernels and splits of K by the matrix's shape). `tiles`: whether the tile
    kernel runs here natively. ValueError where neither can run or `choice` names another."""
    if choice in ("onednn", "mkl"):
        raise ValueError(f"--deterministic needs projections whose rows do not depend on the batch: "
                         f"--cpu-linear tiles or pdserve, not {choice}")
    if tiles and choice in ("auto", "tiles", "amx"):
        log.info("CPU linears: bfloat16 tiles on %s at every step size (--deterministic)", tile_kernel(ops))
        return TileLinear(ops)
    if device.type == "cpu" and PanelLinear.supports(dtype, device, ops):
        if choice in ("tiles", "amx"):
            log.warning("--cpu-linear=%s: the tile kernel cannot run natively here (%s); the panels run instead",
                        choice, tile_kernel(ops))
        return PanelLinear(ops)
    raise ValueError("--deterministic needs the compiled CPU kernels (the tiles or the panels); "
                     f"none runs {dtype} on {device} here")


def use_linear_method(model: nn.Module, method: LinearMethod) -> int:
    """Pack every Linear of the model for `method` and run it through it (copies an earlier method
    made are dropped); the streamed copies go onto huge pages. Returns how many Linears."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    with torch.no_grad():
        for layer in layers:
            layer.copies = {}
            method.pack(layer)
            layer.method = method
    method.place(layers)
    return len(layers)
