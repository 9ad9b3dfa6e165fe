"""The KV connector seam: how KV enters and leaves an engine without the core knowing why.

The scheduling core never names a role. A prefill worker, a decode worker and a colocated worker
run the same scheduler and engine; they differ in their policy and in the connector they plug in
here (the implementations live in kvtransfer/connector.py):

    colocated   NoConnector: nothing enters or leaves
    prefill     blocks of a request that finished here but goes on elsewhere are held, saved out
                after the step (once its first token is published), and freed on the ack
    decode      a request arrives with KV for its first tokens; admission allocates its blocks,
                the step loads the KV into them before the model runs

The connector has two halves, as vLLM's KVConnectorBase_V1 does. The scheduler half decides (which
tokens come from outside, which finished requests keep their blocks, when those are released) and
writes the step's `KVConnectorMetadata`; the worker half acts on that metadata with tensors, through
the ModelRunner's `read_blocks` / `write_blocks`.

Ownership: blocks of a request for which `request_finished` returned True belong to the connector
until `take_released` names it (or the request is aborted); the scheduler then frees them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch

    from pdserve.engine.request import Request


class BlockStore(Protocol):
    """Where the connectors read and write whole KV blocks: a ModelRunner, or a PipelineRunner
    over every stage's layers (engine/pipeline.py)."""

    @property
    def block_size(self) -> int: ...

    def read_blocks(self, block_ids, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def write_blocks(self, block_ids, payload: torch.Tensor) -> None: ...


class KVLoad(NamedTuple):
    """Load the KV of tokens [0, num_tokens) of a request into `block_ids` (in order)."""

    request_id: str
    block_ids: list[int]
    num_tokens: int


class KVStream(NamedTuple):
    """Ship blocks `block_ids` (blocks first_block, first_block + 1, ... of the request) now: a
    prompt chunk completed them and the request goes on elsewhere once its prefill ends."""

    request: Request
    block_ids: list[int]
    first_block: int


class KVSave(NamedTuple):
    """Copy a request's blocks out: a finished one's (they stay allocated until released), or a
    pre-empted one's (offloaded before the step runs, since its blocks are free again)."""

    request: Request
    block_ids: list[int]


@dataclass(slots=True)
class KVConnectorMetadata:
    """What one step asks of the worker half: offloads, then loads, before the model runs;
    streams and saves after its outputs are published."""

    offloads: list[KVSave] = field(default_factory=list)
    loads: list[KVLoad] = field(default_factory=list)
    saves: list[KVSave] = field(default_factory=list)
    streams: list[KVStream] = field(default_factory=list)


class KVConnectorScheduler(ABC):
    """The scheduler's half. Every method runs on the engine thread."""

    # True where the connector ships KV while prompts are prefilled: only then does the engine
    # tell it, step by step, which prompt chunks landed (`chunk_computed`).
    streaming: bool = False

    @abstractmethod
    def num_external_tokens(self, req: Request) -> int:
        """How many of `req`'s first tokens have KV outside, to load at admission (0: none).
        Never all of its tokens: the last one is computed here so that it samples."""

    def num_set_aside(self, req: Request) -> int:
        """Blocks the connector already holds for `req`'s external tokens, their KV partly
        copied in (streamed parts): admission adopts them rather than allocating as many."""
        return 0

    def adopt_blocks(self, req: Request) -> list[int]:
        """Hand the `num_set_aside(req)` blocks over to `req` (they become its first blocks)."""
        return []

    @abstractmethod
    def on_allocated(self, req: Request, block_ids: list[int], num_external: int, meta: KVConnectorMetadata) -> None:
        """Admission gave `req` the blocks for its first `num_external` tokens: schedule the load."""

    @abstractmethod
    def request_finished(self, req: Request, meta: KVConnectorMetadata) -> bool:
        """`req` finished (or was aborted) here. True: its blocks stay held for the connector
        (a save is scheduled in `meta`); False: the scheduler frees them now."""

    @abstractmethod
    def take_released(self) -> list[str]:
        """Held requests whose blocks may be freed now (each named once)."""

    def chunk_computed(self, req: Request, num_tokens: int, meta: KVConnectorMetadata) -> None:
        """A prompt chunk of `req` landed: its first `num_tokens` tokens have KV in every layer.
        A connector that streams KV out while the prompt is prefilled adds a KVStream to `meta`."""

    def request_preempted(self, req: Request, meta: KVConnectorMetadata) -> bool:
        """`req` is pre-empted and loses its blocks. True: the connector keeps its computed KV
        (an offload in `meta`) and `num_external_tokens` offers it back at re-admission;
        False: the request is recomputed from its tokens."""
        return False


class KVConnectorWorker(ABC):
    """The worker's half: moves tensors between the KV cache and the outside world."""

    @abstractmethod
    def load(self, loads: list[KVLoad], runner: BlockStore) -> dict[str, str]:
        """Write each load's KV into its blocks before the step runs. Returns the loads that
        failed, request id -> reason; those requests must not run."""

    @abstractmethod
    def save(self, saves: list[KVSave], runner: BlockStore) -> None:
        """Ship each saved request's blocks out (after the step's outputs are published)."""

    def stream(self, streams: list[KVStream], runner: BlockStore) -> None:
        """Ship each stream's blocks (after the step's outputs are published)."""
        if streams:
            raise AssertionError(f"{type(self).__name__} streams no KV")

    def offload(self, offloads: list[KVSave], runner: BlockStore) -> None:
        """Copy pre-empted requests' blocks out before the step reuses them."""
        if offloads:
            raise AssertionError(f"{type(self).__name__} keeps no pre-empted KV")


class NoConnector(KVConnectorScheduler, KVConnectorWorker):
    """Colocated: all KV is computed here and freed when its request finishes."""

    def num_external_tokens(self, req: Request) -> int:
        return 0

    def on_allocated(self, req: Request, block_ids: list[int], num_external: int, meta: KVConnectorMetadata) -> None:
        raise AssertionError("no external tokens, so nothing to allocate for")

    def request_finished(self, req: Request, meta: KVConnectorMetadata) -> bool:
        return False

    def take_released(self) -> list[str]:
        return []

    def load(self, loads: list[KVLoad], runner: BlockStore) -> dict[str, str]:
        return {}

    def save(self, saves: list[KVSave], runner: BlockStore) -> None:
        pass


class KVConnector(NamedTuple):
    """Both halves of one connector configuration, as an engine takes them."""

    scheduler: KVConnectorScheduler
    worker: KVConnectorWorker

    @classmethod
    def none(cls) -> KVConnector:
        c = NoConnector()
        return cls(c, c)
