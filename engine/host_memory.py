"""The C allocator's handling of a step's large temporaries, on the CPU.

A prefill step of thousands of tokens allocates activations of tens of megabytes in every layer
(the MLP's gate/up output of 8,192 tokens is 50 MB in bfloat16). glibc serves blocks above its
mmap threshold with a fresh mapping and returns freed heap memory to the kernel past its trim
threshold, so each layer's temporaries would be faulted in again page by page, step after step.
A CPU engine therefore keeps blocks of up to 32 MB (glibc's largest mmap threshold) on the heap,
never trims it, and tells glibc to map nothing for malloc at all (M_MMAP_MAX 0): blocks above
32 MB, such as the gate/up output of a step of more than 5,461 tokens (bfloat16; 2,730 in
float32), which a `mixed` step of whole prompts reaches in a burst, would still be mapped afresh.
Every block then comes from the heap, and a burst takes no page faults after its first. The W1
burst offline (64 prompts of 256 tokens, 64 output tokens, `mixed`) measures it:
docs/cpu_kernels.md, "Memory". The cost: a process's heap keeps its largest step's temporaries
(and any large block freed at load time) for reuse rather than handing them back. glibc's
`hugetlb` tunable, which can only be set before the process starts, is not used: it cut the
faults further but made a float32 burst slower (transparent huge pages are compacted on fault).

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

