"""Which GPU each of `pdserve up`'s workers runs on, and its share of that GPU's memory.

`pdserve up --device cuda --gpus 0,1`: the workers, in `pdserve up`'s order (prefill workers, then
decode workers; or the colocated workers), take the listed GPUs in turn, one worker per GPU; with
more workers than GPUs the list starts over, and the workers on one GPU split
--gpu-memory-utilization equally between them (each sizes its KV cache from its share,
engine/device.py kv_cache_blocks). Without --gpus, every GPU this machine shows; `--device
cuda:N` alone keeps every worker on GPU N.

    workers  prefill-0  decode-0  decode-1      --gpus 0,1
    GPU      0          1         0             GPU 0 shared by two: 0.45 of its memory each
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import NamedTuple


class Placement(NamedTuple):
    """A worker's `--device` and `--gpu-memory-utilization`."""

    device: str
    gpu_memory_utilization: float


def parse_gpus(text: str) -> tuple[int, ...]:
    """'0,1' -> (0, 1); ValueError names what is wrong (not an index, repeated)."""
    try:
        gpus = tuple(int(g) for g in text.split(",") if g.strip())
    except ValueError:
        raise ValueError(f"--gpus takes GPU indices like 0,1, got {text!r}") from None
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus takes distinct GPU indices like 0,1, got {text!r}")
    return gpus


def place_workers(num_workers: int, gpus: tuple[int, ...], gpu_memory_utilization: float) -> list[Placement]:
    """Worker i on gpus[i % len(gpus)], with the utilization split among a GPU's workers."""
    if not gpus:
        raise ValueError("no GPU to place the workers on")
    chosen = [gpus[i % len(gpus)] for i in range(num_workers)]
    sharing = Counter(chosen)
    return [Placement(f"cuda:{g}", round(gpu_memory_utilization / sharing[g], 4)) for g in chosen]


def gpus_for(device: str, gpus: str, count_visible: Callable[[], int]) -> tuple[int, ...]:
    """The GPUs `pdserve up` spreads its workers over: --gpus where given, else the index of
    `--device cuda:N`, else every visible one (`count_visible()`, called only then)."""
    if gpus.strip():
        return parse_gpus(gpus)
    _, _, index = device.partition(":")
    if index:
        return parse_gpus(index)
    count = count_visible()
    if count < 1:
        raise ValueError("--device cuda: this machine shows no CUDA GPU")
    return tuple(range(count))
