"""The wire protocol between router, prefill and decode workers.

Every message is a `msgspec.Struct` in one tagged union, encoded as msgpack in the first ZMQ
frame; tensors (KV payloads) follow as raw frames described by a `TensorHeader`. Decoding is
strict: an unknown tag, a missing or mistyped field, or another protocol version is refused.

Every frame travels behind an authentication frame (pdserve.protocol.auth) unless a deployment
runs `--insecure`. The router's `epoch` (random per router start) fences work: a worker drops
every request of an epoch other than its router's (docs/security.md).

Channels:
  worker DEALER --> router ROUTER (control):  Register, Heartbeat, TokenEvents, Goodbye
  router --> worker (same socket):            PrefillRequest, GenerateRequest, Abort, RegisterAck,
                                              HeartbeatAck
  prefill --> decode (KV channel):            KVPart (+ tensor frames) while the prompt is prefilled,
                                              then the KVTransfer that ends the stream (+ its own)
  decode --> prefill (KV channel):            KVAck
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from pdserve.protocol.sampling import SamplingParams

MAX_STAGES = 64  # pipeline stages a heartbeat may report
PROTOCOL_VERSION = 9  # 9: KV streamed in parts (KVPart, KVTransfer.first_block/parts), hand-off timings on TokenEvent; 8: pipeline stages' busy/idle seconds on Heartbeat; 7: KVTransfer.receiver_id, epochs on worker frames and Abort; 6: SamplingParams.structured (structured outputs); 5: retryable error causes, trace context; 4: work carries output_token_ids (migration); 3: router epochs (RegisterAck, work, KVTransfer), HeartbeatAck; 2: Register lost health_address

Role = Literal["prefill", "decode", "colocated"]
FinishReason = Literal["stop", "length", "abort", "error"]
# Why a worker gave a request up, when another worker could still serve it: the router then
# re-dispatches the request (prompt + tokens so far) instead of failing it.
#   refused          the worker would not take it (draining, limits, a transport it lacks)
#   kv_failed        the KV hand-off failed (checksum or fingerprint mismatch, NACK, send error)
#   kv_lease_expired the decode worker could not load the KV before the sender's lease ran out
#   stopped          the worker is shutting down and its drain deadline passed before the end
RetryCause = Literal["", "refused", "kv_failed", "kv_lease_expired", "stopped"]


class _Msg(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    version: int = PROTOCOL_VERSION


class ModelFingerprint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What must match for a KV cache built by one worker to be valid on another."""

    model: str
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int


class TensorHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Describes one raw tensor frame (or a shared-memory / CUDA IPC region)."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: str  # "<algorithm>:<hex digest>" over the raw bytes; see kvtransfer/tensors.py


# --- control channel: worker -> router -------------------------------------------------------


class HandoffTiming(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a disaggregated request's hand-off went, in seconds, as its decode worker measured
    it (on the first token event it sends for the request). From the prefill's first token:

    wait    the prefill worker finishing: the last KV part handed to its transport
    send    that part's staging and crossing, to its arrival at the decode worker
    verify  the decode side checking it (checksum, shape, fingerprint)
    load    waiting for admission, and the KV written into the decode worker's cache

    The gap between the first token and the second is these plus the first decode step.
    """

    wait: float
    send: float
    verify: float
    load: float
    nbytes: int = 0  # KV bytes received for the request, every part
    parts: int = 1  # messages the KV came in (1: whole, after the prefill ended)


class Register(_Msg, tag="register", frozen=True):
    worker_id: str
    role: Role
    kv_address: str  # where this worker's KV channel listens ("" when it has none)
    fingerprint: ModelFingerprint
    num_blocks: int
    max_model_len: int
    kv_transports: tuple[str, ...] = ("tcp",)
    host_id: str = ""  # same host_id: shared memory / CUDA IPC are possible between the two
    # Random per worker process (WorkerLink fills it): a Register with a new incarnation means
    # the worker restarted and lost its requests; the same one is a harmless repeat.
    incarnation: str = ""


class Heartbeat(_Msg, tag="heartbeat", frozen=True):
    worker_id: str
    free_blocks: int
    total_blocks: int
    queued_prefill_tokens: int
    running: int
    waiting: int
    draining: bool = False
    # False while the worker's KV cache is still faulting in (a first burst would pay for it).
    kv_resident: bool = True
    # Cumulative since the worker started (the router turns them into Prometheus counters).
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0
    kv_transfer_seconds: float = 0.0
    # Per pipeline stage, cumulative busy and idle seconds (engine/stage_timeline.py; empty
    # without stages): the router exports them, `pdserve bench` turns them into bubble fractions.
    stage_busy_seconds: Annotated[tuple[float, ...], msgspec.Meta(max_length=MAX_STAGES)] = ()
    stage_idle_seconds: Annotated[tuple[float, ...], msgspec.Meta(max_length=MAX_STAGES)] = ()
    # The epoch of the router it is for (WorkerLink stamps it once registered; "" before): another
    # router drops it, so a frame captured on its way to one router cannot be replayed to another.
    epoch: str = ""


class TokenEvent(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """New tokens of one request since its last event; `finish_reason` set on the last one."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Index in the request's output of token_ids[0] (-1: unknown). The prefill worker's first
    # token and the decode worker's tokens travel on different connections; this lets the
    # router put them back in order.
    position: int = -1
    # With `error`: set when the failure is this worker's alone and the request may be retried
    # elsewhere ("" : it failed for good).
    retry: RetryCause = ""
    handoff: HandoffTiming | None = None  # the decode worker's first event of a handed-off request


class TokenEvents(_Msg, tag="tokens", frozen=True):
    """One worker step's events, batched."""

    worker_id: str
    events: tuple[TokenEvent, ...]
    epoch: str = ""  # as Heartbeat.epoch


class Goodbye(_Msg, tag="goodbye", frozen=True):
    worker_id: str
    epoch: str = ""  # as Heartbeat.epoch


# --- control channel: router -> worker -------------------------------------------------------


class RegisterAck(_Msg, tag="register_ack", frozen=True):
    worker_id: str
    accepted: bool
    reason: str = ""
    epoch: str = ""  # the router's, random per start: a new one fences the worker's old work


class HeartbeatAck(_Msg, tag="heartbeat_ack", frozen=True):
    """The router's answer to a Heartbeat: how a worker learns its router is still there."""

    worker_id: str
    epoch: str


class PrefillRequest(_Msg, tag="prefill", frozen=True):
    request_id: str
    token_ids: tuple[int, ...]
    sampling: SamplingParams
    decode_worker_id: str
    decode_kv_address: str
    kv_transport: str = "tcp"
    arrival_time: float = 0.0
    epoch: str = ""  # the router's epoch (ControlServer stamps it)
    # Tokens the request already generated on a worker that was lost: recomputed here (through
    # the prefix cache where it holds them), and generation goes on from the next position.
    output_token_ids: tuple[int, ...] = ()
    # W3C `traceparent` of the router span this work belongs to ("" : not traced).
    trace_context: str = ""


class GenerateRequest(_Msg, tag="generate", frozen=True):
    """Colocated mode: the worker prefills and decodes the request itself."""

    request_id: str
    token_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival_time: float = 0.0
    epoch: str = ""
    output_token_ids: tuple[int, ...] = ()  # as in PrefillRequest
    # W3C `traceparent` of the router span this work belongs to ("" : not traced).
    trace_context: str = ""


class Abort(_Msg, tag="abort", frozen=True):
    request_ids: tuple[str, ...]
    epoch: str = ""  # the router's (ControlServer stamps it): a worker drops an Abort of another


# --- KV channel: prefill <-> decode ----------------------------------------------------------


class KVTransfer(_Msg, tag="kv", frozen=True):
    """A prefilled request handed to a decode worker: its tokens so far and its KV blocks.

    The KV of the first `num_computed_tokens` tokens is [num_layers, 2, num_blocks, block_size,
    num_kv_heads, head_dim]. This message's payload holds blocks [first_block, num_blocks);
    `location` says where its bytes are. Blocks before `first_block` came earlier, streamed in
    `parts` KVPart messages while the prompt was still being prefilled (0 parts: sent whole).
    """

    request_id: str
    prefill_worker_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    sampling: SamplingParams
    num_computed_tokens: int
    fingerprint: ModelFingerprint
    tensor: TensorHeader
    transport: str  # "tcp" (next frame), "shm" or "cuda_ipc"
    location: bytes = b""  # transport-specific: shm segment name and offset, CUDA IPC handle
    arrival_time: float = 0.0
    # time.time() on the sender's host after which it may reuse a shm / CUDA IPC region (0: the
    # payload travelled inline). Meaningful only on the same host, which is where those run.
    lease_deadline: float = 0.0
    # The router epoch the prefill worker took the request under: a decode worker NACKs another.
    epoch: str = ""
    trace_context: str = ""  # the prefill worker's "kv sent" span, parent of the decode side's
    # The decode worker it is for (its worker_id, from PrefillRequest.decode_worker_id): every other
    # receiver drops it, so a transfer captured on its way cannot be replayed into another one.
    receiver_id: str = ""
    first_block: int = 0
    parts: int = 0
    # The prefill worker's wall clock: its first token out, and this message handed to the transport.
    first_token_at: float = 0.0
    sent_at: float = 0.0


class KVPart(_Msg, tag="kv_part", frozen=True):
    """Blocks [first_block, first_block + tensor.shape[2]) of a request's KV, every layer, sent
    while its prompt is still being prefilled (`--kv-streaming layer`). The decode worker keeps
    the parts of a stream (`seq` 0, 1, ...) until its KVTransfer ends it; `cancel` ends it
    without one (the request ended at its first token, or was aborted): drop what came.
    """

    request_id: str
    prefill_worker_id: str
    receiver_id: str
    seq: int
    first_block: int
    total_blocks: int  # blocks of the whole transfer, to bound what the stream may send
    fingerprint: ModelFingerprint
    tensor: TensorHeader
    transport: str
    location: bytes = b""
    cancel: bool = False


class KVAck(_Msg, tag="kv_ack", frozen=True):
    request_id: str
    ok: bool
    reason: str = ""


Message = (
    Register
    | Heartbeat
    | TokenEvents
    | Goodbye
    | RegisterAck
    | HeartbeatAck
    | PrefillRequest
    | GenerateRequest
    | Abort
    | KVTransfer
    | KVPart
    | KVAck
)
