"""Every list of names the options, the code and the wire share, defined once (torch-free)."""

from __future__ import annotations

KV_TRANSPORTS = ("tcp", "shm", "cuda_ipc")
KV_STREAMING = ("layer", "request")  # --kv-streaming: a prefill chunk's KV leaves as it lands, or all at the end
AUTO_DTYPE = "auto"  # bfloat16 where the device computes it natively, else float32 (model/config.py)
DTYPES = (AUTO_DTYPE, "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("cpu", "reference", "triton")
# The CPU projections (engine/runner.py picks under "auto"); "amx" is the old name of "tiles".
CPU_LINEARS = ("auto", "tiles", "amx", "pdserve", "onednn", "mkl")
# The compiled CPU kernels (kernels/cpu_ops.py): auto picks the best prebuilt variant this CPU
# runs, else builds them here (native); off runs the PyTorch reference.
CPU_KERNELS = ("auto", "avx2", "avx512", "avx512-bf16", "amx", "native", "off")

# Batching policies of an engine that takes prompts (engine/policies.py implements each).
STATIC, PREFILL_FIRST, MIXED, CHUNKED = "static", "prefill-first", "mixed", "chunked"
COLOCATED_POLICIES = (STATIC, PREFILL_FIRST, MIXED, CHUNKED)
# A disaggregated decode worker's policy: its requests arrive with their KV.
DECODE_ONLY = "decode-only"
POLICIES = (*COLOCATED_POLICIES, DECODE_ONLY)
