"""The weight layouts of the compiled CPU linears; `x @ W.T` on the plain weight is their oracle.

- Panels (kernels/csrc/cpu_linear.cpp): W [N, K] packed once, at load, into panels of 24 output
  columns, [ceil(N/24), K, 24], the last one zero-padded: each panel then streams front to back
  while the kernel multiplies it with a block of rows of x. float32 and bfloat16.
- Tiles (kernels/csrc/cpu_linear_tiles.cpp): bfloat16 W [N, K] packed into
  [ceil(N/32), K/32, 16, 2, 32], the pair-interleaved "B" tiles AMX's TDPBF16PS reads (the two
  of a step with their rows interleaved), a group of 32 output columns' tiles in K order. K must
  be a multiple of 32. Where there is no AMX but AVX512-BF16 (Zen 4), VDPBF16PS reads the same
  layout: each tile row is one zmm of 16 column pairs.
"""

from __future__ import annotations

import torch

PANEL = 24
TILE_GROUP = 32  # output columns per group of tiles
TILE_STEP = 32  # K per tile row (32 bfloat16 = 64 bytes)
# Up to this many rows the tiles run (decode steps, small prefills); above it oneDNN's packed
# matmul, where it is there too. The tiles stream a decode step's weights faster than oneDNN
# (on AMX and VDPBF16PS alike); with SiLU-mul applied in the tile gate/up projection, whole
# prefills stay faster on tiles up to this size and are even just above it, and large ones are
# faster on oneDNN, whose cache blocking feeds its AMX tiles from L1 where ours load from L2
# (`python -m pdserve.bench.engine_overhead` against `--cpu-linear onednn`; docs/cpu_kernels.md,
# "Tiles").
TILE_MAX_ROWS = 384


def _padded(weight: torch.Tensor, multiple: int) -> tuple[torch.Tensor, int]:
    """W [N, K] with zero rows appended up to a multiple of `multiple` rows, and how many groups
    of `multiple` that makes."""
    n, k = weight.shape
    groups = -(-n // multiple)
    padded = weight.new_zeros(groups * multiple, k)
    padded[:n] = weight
    return padded, groups


def _rows_through(op, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [..., K] -> [..., N] through a compiled op that takes [M, K] rows."""
    if x.dim() == 2:
        return op(x, packed, out_features)
    return op(x.reshape(-1, x.shape[-1]), packed, out_features).view(*x.shape[:-1], out_features)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] (any strides) -> contiguous [ceil(N/24), K, 24] panels in the same dtype."""
    padded, panels = _padded(weight, PANEL)
    return padded.view(panels, PANEL, weight.shape[1]).transpose(1, 2).contiguous()


def linear(ops: object, x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [..., K] -> [..., N] through the compiled kernel (float32 or bfloat16 CPU tensors)."""
    return _rows_through(ops.linear, x, panels, out_features)  # type: ignore[attr-defined]


def fuses_silu_mul(intermediate: int) -> bool:
    """Whether a gate/up projection of this intermediate size can apply SiLU-mul in the panel
    kernel (`linear_silu_mul`): each half must be whole panels."""
    return intermediate % PANEL == 0


def linear_silu_mul(ops: object, x: torch.Tensor, panels: torch.Tensor, intermediate: int) -> torch.Tensor:
    """silu(gate) * up of x [..., K] through the panels of a gate/up weight [2 I, K] (the gate's
    I columns, then the up's), in one pass: -> [..., I]. Needs fuses_silu_mul(I)."""
    return _rows_through(ops.linear_silu_mul, x, panels, intermediate)  # type: ignore[attr-defined]


def tile_kernel(ops: object | None) -> str:
    """What runs the tile kernels here: "amx"; "avx512_bf16" (VDPBF16PS over the same packed layout,
    on CPUs with AVX512-BF16 and no AMX, such as Zen 4); "portable" (a plain loop that keeps the
    layout tested everywhere, far too slow to pick); or "none" without the compiled ops."""
    return "none" if ops is None else str(ops.tile_kernel())  # type: ignore[attr-defined]


def tiles_run(ops: object | None) -> bool:
    """Whether the tile kernels run on native bfloat16 instructions here (AMX or AVX512-BF16)."""
    return tile_kernel(ops) in ("amx", "avx512_bf16")


def tiles_fit(weight: torch.Tensor) -> bool:
    """Whether the tile kernel takes this weight: bfloat16 with K a multiple of 32."""
    return weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % TILE_STEP == 0


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """bfloat16 [N, K] (any strides) -> contiguous [ceil(N/32), K/32, 16, 2, 32] tiles:
    element [g, s, r, t, 2c + j] = W[32g + 16t + c, 32s + 2r + j], columns past N zero. The two
    B tiles of a step interleave their rows (t is the inner index): one row of each, 128 bytes,
    is what a VDPBF16PS k pair reads, and AMX loads each tile with a 128-byte stride."""
    if not tiles_fit(weight):
        raise ValueError(f"Tiles take a bfloat16 [N, K] weight with K a multiple of {TILE_STEP}, "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    padded, groups = _padded(weight, TILE_GROUP)
    steps = weight.shape[1] // TILE_STEP
    tiles = padded.view(groups, 2, 16, steps, 16, 2).permute(0, 3, 4, 1, 2, 5)
    return tiles.contiguous().view(groups, steps, 16, 2, 32)


def pack_gate_up_tiles(weight: torch.Tensor, intermediate: int) -> torch.Tensor:
    """A gate/up weight [2 I, K] (the gate's I rows, then the up's) as pack_tiles packs it, its
    groups of 32 columns reordered in pairs: gate group p, then up group p, for p < I / 32. The
    order `tile_linear_silu_mul` reads them in: each thread's share of the weight is one stream
    through memory instead of two, 1.8 MB apart for SmolLM2. Through `tile_linear` these tiles
    give the columns in the same pairs: `unpair_gate_up` puts them back. Needs
    tiles_fuse_silu_mul(I)."""
    if not tiles_fuse_silu_mul(intermediate) or weight.dim() != 2 or weight.shape[0] != 2 * intermediate:
        raise ValueError(f"a gate/up weight of 2 x {intermediate} rows in whole groups of {TILE_GROUP}, "
                         f"got {tuple(weight.shape)}")
    tiles = pack_tiles(weight)
    pairs = intermediate // TILE_GROUP
    return tiles.view(2, pairs, *tiles.shape[1:]).transpose(0, 1).contiguous().view(tiles.shape)


def unpair_gate_up(y: torch.Tensor, intermediate: int) -> torch.Tensor:
    """The columns of a projection through pack_gate_up_tiles' tiles [..., 2 I], in pairs of
    groups, back in the weight's order (the gate's I, then the up's)."""
    pairs = intermediate // TILE_GROUP
    return y.unflatten(-1, (pairs, 2, TILE_GROUP)).transpose(-3, -2).flatten(-3)


def tile_linear(ops: object, x: torch.Tensor, tiles: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [..., K] -> [..., N] through the tile kernel (bfloat16 CPU tensors): AMX, AVX512-BF16
    or the portable loop, whichever tile_kernel names."""
    return _rows_through(ops.tile_linear, x, tiles, out_features)  # type: ignore[attr-defined]


def tiles_fuse_silu_mul(intermediate: int) -> bool:
    """Whether a gate/up projection of this intermediate size can apply SiLU-mul in the tile
    kernel (`tile_linear_silu_mul`): each half must be whole groups of 32 columns."""
    return intermediate % TILE_GROUP == 0


def tile_linear_silu_mul(ops: object, x: torch.Tensor, tiles: torch.Tensor, intermediate: int) -> torch.Tensor:
    """silu(gate) * up of x [..., K] through a gate/up weight [2 I, K] (the gate's I columns,
    then the up's) packed by pack_gate_up_tiles, in one pass: -> [..., I], to the bit what
    tile_linear, unpair_gate_up and silu_mul give. Needs tiles_fuse_silu_mul(I)."""
    return _rows_through(ops.tile_linear_silu_mul, x, tiles, intermediate)  # type: ignore[attr-defined]
