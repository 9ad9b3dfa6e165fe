"""Tensors on transparent huge pages, for the CPU data every decode step streams whole.

The KV cache is allocated once and read all over at every decode step. On 4 KiB pages a decode
step at batch 32 walks some 46,000 pages of it, and the hardware prefetchers stop at every page
boundary. `zeros_on_huge_pages` maps it anonymously and asks for transparent huge pages
(`madvise(MADV_HUGEPAGE)`, which works where the kernel's policy is `madvise` or `always`), its
pages faulted in after start-up on a background thread (`fault_in_background`). Decode attention
from DRAM runs faster on them, most of all with a sequence's blocks apart, as a long-running
server's free list leaves them (`python -m pdserve.bench.cpu_attention_bench --spread 1 3`
times both page sizes side by side; docs/cpu_kernels.md, "Memory").

The packed weights of the compiled matmuls go the same way, all of them side by side in one
mapping (`copies_on_huge_pages`; most projections are smaller than a huge page), which speeds up
their matmuls at one row from DRAM (`python -m pdserve.bench.engine_overhead`, decode batch 1;
docs/cpu_kernels.md, "Memory").
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import sys
import threading
import time
import weakref

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 * 2**20  # x86-64's transparent huge page


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in an anonymous mapping advised for transparent huge pages (see the
    module docstring), its data starting on a huge page boundary. Where mmap has no
    MADV_HUGEPAGE (not Linux) or the tensor is smaller than a huge page: plain `torch.zeros`."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    # Private: a shared anonymous mapping is shmem, whose huge pages follow another policy (shmem_enabled).
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled
    base = torch.frombuffer(mapping, dtype=torch.uint8)  # holds `mapping` open while it lives
    start = -base.data_ptr() % HUGE_PAGE
    try:
        mapping.madvise(advice, start, nbytes - nbytes % mmap.PAGESIZE)
    except OSError as e:  # EINVAL where the kernel has no transparent huge pages
        log.info("no transparent huge pages for a %d MB tensor: %s", nbytes >> 20, e)
    # Not touched here: the mapping reads as zeros already, and faulting in huge pages can mean
    # compacting memory first (the kernel's `defrag` policy for advised mappings), milliseconds a
    # page on a fragmented host: zeroing a KV cache at start-up can take seconds and make a
    # restarted worker miss the chaos test's deadline. Each page faults in on first use.
    return base[start:start + nbytes].view(dtype).view(shape)


def copies_on_huge_pages(tensors: list[torch.Tensor], align: int = 4096) -> list[torch.Tensor]:
    """Contiguous copies of CPU `tensors` side by side (each at an `align`-byte boundary) in one
    zeros_on_huge_pages mapping, which lives as long as any of them."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // align) * align
    arena = zeros_on_huge_pages((total,), torch.uint8)
    copies = []
    for t, at in zip(tensors, offsets, strict=True):
        copy = arena[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        copy.copy_(t)
        copies.append(copy)
    return copies


def huge_page_share(t: torch.Tensor) -> float:
    """The share of the memory mapping that holds `t`'s first byte backed by transparent huge pages:
    its AnonHugePages over its size in /proc/self/smaps, 0.0 where that cannot be read (not Linux).
    A zeros_on_huge_pages tensor's advised range is a mapping of its own (madvise splits it off)."""
    if t.device.type != "cpu" or t.numel() == 0:
        return 0.0
    address = t.data_ptr()
    try:
        with open("/proc/self/smaps") as smaps:
            size = 0
            for line in smaps:
                field = line.split(maxsplit=1)[0]
                if not field.endswith(":"):  # a mapping's first line: start-end perms offset ...
                    start, end = (int(a, 16) for a in field.split("-"))
                    size = end - start if start <= address < end else 0
                elif size and field == "AnonHugePages:":
                    return int(line.split()[1]) * 1024 / size
    except (OSError, ValueError) as e:
        log.info("no huge page figures for a tensor: %s", e)
    return 0.0


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable, their contents unchanged


def fault_in_background(cache: torch.Tensor, block_dim: int = 2) -> threading.Thread | None:
    """Fault in the pages of a block-paged cache on a background thread at the lowest priority
    (nice 19), lowest block ids first, the order the block pool hands them out. For each run of
    blocks that fills a huge page, every region in front of `block_dim` (for the KV cache
    [L, 2, blocks, ...]: each layer's keys and values) is faulted in together.

    Why: `zeros_on_huge_pages` leaves the cache untouched at start-up, and a page's first write
    costs far more than its reads: prefills into fresh pages, and a burst of requests right after
    start-up, run far slower than on resident pages (docs/cpu_kernels.md, "Memory";
    `python -m pdserve.bench.engine_overhead` waits for this thread before it times anything). In
    a VM the guest zeroes each 2 MB page and the host backs it 4 KiB at a time; that cost is the
    host's, so the thread's priority hardly changes it, and nice 19 keeps its guest-side work
    behind the engine's. `madvise(MADV_POPULATE_WRITE)` faults pages in without changing what
    they hold, so blocks already in use are safe. Workers report when it is done
    (`ModelRunner.kv_cache_resident`, the router's /ready?warm=1). Returns the thread, or None
    where there is nothing to do (not Linux, or a cache smaller than a huge page)."""
    nbytes = cache.numel() * cache.element_size()
    if not sys.platform.startswith("linux") or nbytes < HUGE_PAGE or not cache.is_contiguous():
        return None
    regions = math.prod(cache.shape[:block_dim])
    num_blocks = cache.shape[block_dim]
    block_bytes = nbytes // (regions * num_blocks)
    blocks_per_chunk = max(1, HUGE_PAGE // block_bytes)
    thread = threading.Thread(
        target=_fault_in, name="kv-fault-in", daemon=True,
        args=(weakref.ref(cache), regions, num_blocks, block_bytes, blocks_per_chunk))
    thread.start()
    return thread


def _fault_in(ref: weakref.ref[torch.Tensor], regions: int, num_blocks: int, block_bytes: int, blocks_per_chunk: int) -> None:
    try:  # Linux: a thread id names this thread alone
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError) as e:
        log.info("KV cache fault-in runs at normal priority: %s", e)
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = mmap.PAGESIZE
    started = time.perf_counter()
    for first in range(0, num_blocks, blocks_per_chunk):
        cache = ref()  # held only while a chunk faults in: a dropped engine frees its cache at once
        if cache is None:
            return
        base = cache.data_ptr()
        for region in range(regions):
            start = base + (region * num_blocks + first) * block_bytes
            end = start + min(blocks_per_chunk, num_blocks - first) * block_bytes
            aligned = start - start % page
            # ctypes releases the GIL for the call: the engine's Python threads run meanwhile.
            if madvise(aligned, end - aligned, MADV_POPULATE_WRITE) != 0:
                log.info("KV cache fault-in stopped: %s", os.strerror(ctypes.get_errno()))
                return
        del cache
    log.info("KV cache faulted in (%d blocks) in %.1f s", num_blocks, time.perf_counter() - started)
