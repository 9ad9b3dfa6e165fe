"""The C allocator's handling of a step's large temporaries, on the CPU.

A prefill step of thousands of tokens allocates activations of tens of megabytes in every layer
(the MLP's gate/up output of 8,192 tokens is 50 MB in bfloat16). glibc serves blocks above its
mmap threshold with a fresh mapping and returns freed heap memory to the kernel past its trim
threshold, so each layer's temporaries were faulted in again page by page: a 64-prompt burst of
256-token prompts took 1.5 million minor page faults, and on a 2-core Sapphire Rapids an
8,192-token prefill step spent about a fifth of its time in them. Keeping blocks of up to
32 MB (glibc's largest mmap threshold) on the heap and never trimming it reuses the same pages
step after step: the same burst, offline in bfloat16, then took 0.69 million faults and served
9.6-10.1 requests/s against 8.4-8.8. (glibc's `hugetlb` tunable, which can only be set before
the process starts, cut the faults to 65 thousand and helped bfloat16 a little more, but made a
float32 burst 8% slower: transparent huge pages are compacted on fault.)

The blocks above 32 MB still got a fresh mapping each time: the gate/up output of a step of more
than 5,461 tokens (bfloat16; 2,730 in float32), which a `mixed` step of whole prompts reaches in
a burst. So glibc is also told to map nothing for malloc at all (M_MMAP_MAX 0): every block comes
from the heap, which is never trimmed. On a 2-core Sapphire Rapids the MLPs of an 8,192-token
step in bfloat16 then took 835-848 ms against 1,445-1,513 (the same as running them 2,048 rows at
a time), and the W1 burst (64 prompts of 256 tokens, 64 output tokens, `mixed`, offline) served
9.05-9.50 requests/s against 7.80-8.43, with no page faults after its first burst against 0.73
million per burst. The cost: a process's heap keeps its largest step's temporaries (and any large
block freed at load time) for reuse rather than handing them back.

The KV cache and the packed weights go on transparent huge pages instead: kernels/huge_pages.py.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
MMAP_THRESHOLD = 32 * 2**20  # glibc's maximum (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: about 2 GB, in effect never

_tuned: bool | None = None


def keep_step_memory() -> bool:
    """Tell glibc to keep freed step temporaries for reuse (see the module docstring). Once per
    process; False, and nothing changed, where the C library is not glibc."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.info("no glibc mallopt here: the allocator keeps its defaults")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _tuned = all(mallopt(param, value) for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_MMAP_MAX, 0)))
    return _tuned

