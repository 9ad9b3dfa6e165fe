"""Where a Triton kernel runs: compiled for CUDA tensors, in Triton's interpreter for CPU ones.

Triton decides at `@triton.jit` time, for its own library functions (`tl.zeros`, `tl.sum`...)
as much as for ours, whether a kernel is compiled or interpreted: `TRITON_INTERPRET=1` must be in
the environment before `triton` is first imported in the process. Then the same kernels run on
CPU tensors, slowly (seconds for a 1k-token prefill): that is how they are tested without a GPU,
not a CPU fast path (the reference backend is).
"""

from __future__ import annotations

from typing import Any

import torch
import triton

try:  # not public API; without it only the CPU (test) path is lost
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - depends on the installed triton
    InterpretedFunction = None  # type: ignore[assignment,misc]


def is_interpreted(kernel: Any) -> bool:
    """True when `kernel` runs in Triton's interpreter (`TRITON_INTERPRET=1` at import)."""
    return InterpretedFunction is not None and isinstance(kernel, InterpretedFunction)


class OnDevice:
    """`kernel[grid](*args)` launched with `index` as the current CUDA device. Triton launches on
    the current device (and its current stream) whatever its tensors' device, so an engine on
    cuda:1 in a thread whose current device is cuda:0 would run its kernels on cuda:0 against
    cuda:1's memory."""

    __slots__ = ("index", "kernel")

    def __init__(self, kernel: Any, index: int) -> None:
        self.kernel, self.index = kernel, index

    def __getitem__(self, grid: Any) -> Any:
        launch = self.kernel[grid]

        def on_device(*args: Any, **kwargs: Any) -> Any:
            with torch.cuda.device(self.index):
                return launch(*args, **kwargs)

        return on_device


def for_device(kernel: Any, device: torch.device) -> Any:
    """`kernel`, after checking that it can run on tensors on `device`, launched on it. Every
    launch passes the device of its own tensor arguments (q.device, x.device...). On CUDA the
    kernel runs on that device: as it is where that is already the current device (select_device
    makes the engine's device current, so a worker's launches cost nothing more), else wrapped
    to switch to it for the launch (OnDevice)."""
    if device.type in ("cuda", "cpu") and is_interpreted(kernel):
        return kernel  # the interpreter runs on the host, whatever the tensors' device
    if device.type == "cuda":
        if device.index is None or device.index == torch.cuda.current_device():
            return kernel
        return OnDevice(kernel, device.index)
    if device.type == "cpu":
        raise ValueError(
            "triton kernels run on CPU tensors only in Triton's interpreter: set TRITON_INTERPRET=1 "
            "in the environment before triton is first imported, or use the reference backend"
        )
    raise ValueError(
        f"the triton attention backend runs on CUDA (or CPU for tests), not {device.type}"
    )


def pow2_at_least(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor): tile extents must be powers of two."""
    return max(triton.next_power_of_2(max(n, 1)), floor)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs must not be rounded to tf32 on the tensor cores, or fp32 loses 3 digits."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dot(dtype: torch.dtype, kernel: Any) -> bool:
    """Triton 3.9's interpreter multiplies the raw bit patterns in `tl.dot` on bfloat16 inputs
    (triton-lang/triton#11584; fp16 and fp32 are right); upcasting the operands to float32 first gives the same result as the hardware's
    bf16 x bf16 -> fp32 product, which is exact in fp32."""
    return is_interpreted(kernel) and dtype == torch.bfloat16
