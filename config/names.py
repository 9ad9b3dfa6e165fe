"""Every list of names the options, the code and the wire share, defined once (torch-free)."""

from __future__ import annotations

KV_TRANSPORTS = ("tcp", "shm", "cuda_ipc")
AUTO_DTYPE = "auto"  # bfloat16 where the device computes it natively, else float32 (model/config.py)
DTYPES = (AUTO_DTYPE, "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("cpu", "reference", "triton")

# Batching policies of an engine that takes prompts (engine/policies.py implements each).
STATIC, PREFILL_FIRST, MIXED, CHUNKED = "static", "prefill-first", "mixed", "chunked"
COLOCATED_POLICIES = (STATIC, PREFILL_FIRST, MIXED, CHUNKED)
# A disaggregated decode worker's policy: its requests arrive with their KV.
DECODE_ONLY = "decode-only"
POLICIES = (*COLOCATED_POLICIES, DECODE_ONLY)
