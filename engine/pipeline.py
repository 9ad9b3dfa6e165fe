"""Pipeline parallelism: one model split by layers into stages, each a process of its own.

    stage 0: the worker's own process           stages 1 .. N-1: `python -m pdserve.engine.pipeline`
    schedules, embeds, runs its layers ──hidden──► its layers ──► ... ──► the last: the final norm
    LM head + sampler ◄──────────── the rows that sample ─────────────────────┘

Stage 0 is the engine the worker (and the router) sees: it schedules, owns the requests' state
and samples. The LM head goes with the sampler, and the sampler with the requests' state
(penalties, seeds, grammar matchers): so the last stage sends back only the sampling rows'
hidden states ([rows, H], a few KB), not logits. Each stage holds its layers' weights and their
KV cache only; the block tables are stage 0's, the same block ids in every stage's cache.

Up to N micro-batches are in flight: while stage 1 computes one, stage 0 schedules and computes
the next. The scheduler keeps a request out of a new micro-batch while one in flight samples for
it (Scheduler.launched / update); a prompt's chunks, which sample nothing until the last, follow
each other through the stages back to back, so one long prompt fills the pipeline too.

The links are torch.distributed's gloo process groups, point to point over TCP bound to
127.0.0.1 (the stages of a worker share its host; nothing else can reach them):
- "fwd": stage 0 -> each stage k, every command in order (a fixed header, then its body); stage
  k-1 -> stage k, a step's hidden states and the stages' timings; the last stage -> stage 0, the
  sampling rows and the timings.
- "kv": whole KV blocks between stage 0 and each stage (the connectors' read_blocks and
  write_blocks). Their commands go in the fwd order, so a load lands before the step that reads
  it, and a save reads after every step that wrote it.

A stage that dies closes its links: the next wait on them raises PipelineBroken, which takes
the whole worker down (the router migrates its requests); the other stages see their links close,
or their parent die (PR_SET_PDEATHSIG), and exit.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import datetime
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from array import array
from collections import deque
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # pyright: ignore[reportPrivateImportUsage]

from pdserve.config.engine import EngineConfig, add_engine_arguments, engine_argv, engine_config
from pdserve.engine.kv_cache import BlockIds, KVPayloadError
from pdserve.engine.request import Request
from pdserve.engine.runner import ModelRunner, PackedStep
from pdserve.engine.sampler import SampleResult
from pdserve.engine.scheduler import ScheduledRequest
from pdserve.engine.stage_timeline import Interval, StageTimeline
from pdserve.model.config import Keep, ModelConfig
from pdserve.model.llama import StageLayers

log = logging.getLogger(__name__)

STOP, STEP, WRITE, READ = 0, 1, 2, 3
HEADER = 8  # int64s: kind, then the command's sizes
LINK_TIMEOUT_S = 300.0  # a wait on a stage longer than this is a hung stage (a 4k prompt takes seconds)
CONNECT_TIMEOUT_S = 120.0  # the stages' processes start and load their weights


class PipelineBroken(RuntimeError):
    """A stage died or a link between stages failed: the worker cannot go on."""


def split_layers(num_layers: int, stages: int, spec: str | None = None) -> list[StageLayers]:
    """Each stage's layers: `spec` ("15,15"), else as even as the count allows, the earlier
    stages taking the smaller shares (the first stage also runs the LM head and the sampler)."""
    if spec:
        counts = [int(c) for c in spec.split(",")]
        if len(counts) != stages or min(counts) < 1 or sum(counts) != num_layers:
            raise ValueError(f"--pp-layer-split {spec!r} must give {stages} stages of at least one layer "
                             f"each, {num_layers} layers in all")
    else:
        if stages > num_layers:
            raise ValueError(f"{stages} pipeline stages need at least {stages} layers; the model has {num_layers}")
        base, extra = divmod(num_layers, stages)
        counts = [base + (1 if i >= stages - extra else 0) for i in range(stages)]
    out, start = [], 0
    for c in counts:
        out.append(StageLayers(start, start + c, num_layers))
        start += c
    return out


def stage_weights(config: EngineConfig, stage: int) -> Keep | None:
    """What a stage reads of the model's file: its own tensors (None: one stage, everything)."""
    if config.pipeline_parallel_size == 1:
        return None
    stages, split = config.pipeline_parallel_size, config.pp_layer_split

    def keep(model: ModelConfig, name: str) -> bool:
        return split_layers(model.num_layers, stages, split)[stage].owns(name, model.tie_word_embeddings)

    return keep


def stage_cores(cores: list[int], stages: int) -> list[list[int] | None]:
    """Each stage's share of `cores`, contiguous and as even as possible; None for every stage
    where there are fewer cores than stages (they share)."""
    if len(cores) < stages:
        return [None] * stages
    return [cores[i * len(cores) // stages:(i + 1) * len(cores) // stages] for i in range(stages)]


# --- the links ------------------------------------------------------------------------------
@dataclass(slots=True)
class Links:
    fwd: dist.ProcessGroupGloo
    kv: dist.ProcessGroupGloo
    store: Store


def connect(rank: int, world: int, port: int, store: Store | None = None) -> Links:
    """Both process groups of one pipeline, through the TCP store stage 0 hosts on `port`."""
    timeout = datetime.timedelta(seconds=CONNECT_TIMEOUT_S)
    if store is None:
        store = TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)

    def group(name: str) -> dist.ProcessGroupGloo:
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = datetime.timedelta(seconds=LINK_TIMEOUT_S)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        return dist.ProcessGroupGloo(PrefixStore(name, store), rank, world, opts)

    return Links(group("fwd"), group("kv"), store)


def _wait(work, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as exc:
        raise PipelineBroken(f"pipeline link failed ({what}): {exc}") from exc


def _send(group: dist.ProcessGroupGloo, tensor: torch.Tensor, dst: int):
    return group.send([tensor], dst, 0)  # type: ignore[attr-defined]


def _recv(group: dist.ProcessGroupGloo, tensor: torch.Tensor, src: int, what: str) -> torch.Tensor:
    _wait(group.recv([tensor], src, 0), what)  # type: ignore[attr-defined]
    return tensor


# --- a step on the wire ---------------------------------------------------------------------
def encode_step(mb: int, step: PackedStep) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's header and body for the stages after the first (no token ids: they take hidden
    states): positions, slots, sequence lengths, block tables, cu_seqlens, sampling rows."""
    body = array("q")
    for part in (step.positions, step.slots, step.seq_lens, step.tables, step.cu, step.sample_rows):
        body.extend(part if part.typecode == "q" else array("q", part))
    n_seqs = len(step.seq_lens)
    header = torch.tensor([STEP, mb, step.num_tokens, step.num_decode_rows, n_seqs, step.width, len(step.cu),
                           len(step.sample_rows)], dtype=torch.int64)
    return header, (torch.frombuffer(body, dtype=torch.int64) if body else torch.empty(0, dtype=torch.int64))


def step_body_size(header: torch.Tensor) -> int:
    _, _, t, _, n_seqs, width, n_cu, n_sample = (int(v) for v in header.tolist())
    return 2 * t + n_seqs + n_seqs * width + n_cu + n_sample


def decode_step(header: torch.Tensor, body: torch.Tensor) -> PackedStep:
    _, _, t, nd, n_seqs, width, n_cu, n_sample = (int(v) for v in header.tolist())
    values = body.tolist()
    parts, at = [], 0
    for n, code in ((t, "q"), (t, "q"), (n_seqs, "i"), (n_seqs * width, "i"), (n_cu, "i"), (n_sample, "q")):
        parts.append(array(code, values[at:at + n]))
        at += n
    positions, slots, seq_lens, tables, cu, sample_rows = parts
    return PackedStep(array("q"), positions, slots, seq_lens, cu, tables, width, nd, sample_rows, [])


def as_bytes(*parts: torch.Tensor) -> torch.Tensor:
    """Contiguous tensors' bytes end to end in one uint8 tensor (one message instead of several:
    each gloo message costs a round trip, the receiver posting its buffer first)."""
    flat = [p.contiguous().reshape(-1).view(torch.uint8) for p in parts]
    return torch.cat(flat) if len(flat) > 1 else flat[0].clone()


def split_bytes(payload: torch.Tensor, *specs: tuple[torch.dtype, tuple[int, ...]]) -> list[torch.Tensor]:
    """as_bytes undone: views of `payload` with these dtypes and shapes (each part's size a
    multiple of 8 bytes but the last, so that every view is aligned)."""
    out, at = [], 0
    for dtype, shape in specs:
        n = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
        out.append(payload[at:at + n].view(dtype).view(shape))
        at += n
    if at != payload.numel():
        raise PipelineBroken(f"a pipeline message of {payload.numel()} bytes, expected {at}")
    return out


# --- stage 0 ----------------------------------------------------------------------------------
@dataclass(slots=True)
class MicroBatch:
    id: int
    step: PackedStep
    started: float  # stage 0's layers: start and end
    ended: float
    sent: int  # sends posted up to this micro-batch's: all taken once it comes back


class PipelineRunner:
    """Stage 0 of a pipeline: a ModelRunner for its own layers, the other stages' processes, and
    the links to them. What the engine calls: submit a step, collect the oldest, and the
    connectors' read_blocks / write_blocks over every stage."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, state_dict, max_model_len: int,
                 num_blocks: int, consume_weights: bool = False) -> None:
        n = config.pipeline_parallel_size
        self.num_stages = self.depth = n
        self.model_config = model_config
        self.stages = split_layers(model_config.num_layers, n, config.pp_layer_split)
        self.timeline = StageTimeline(n)
        self._ids = 0
        # (work, tensor) of sends not waited for yet (the tensors stay alive with them): a gloo
        # work says it is done only once waited on, and waiting is safe once a later answer shows
        # the peer took it. `_posted` counts them; `_waited` how many have been waited for.
        self._sends: deque = deque()
        self._posted = self._waited = 0
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        self.broken: str | None = None
        self._affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        shares = stage_cores(self._affinity or [], n) if config.pp_pin and self._affinity else [None] * n
        threads = torch.get_num_threads()
        store = TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT_S))
        try:
            # Stage 0 builds its runner first: `deterministic` resolved here is every stage's.
            self._threads = threads
            if shares[0] is not None:
                os.sched_setaffinity(0, shares[0])
                torch.set_num_threads(len(shares[0]))
            self.runner = ModelRunner(config, model_config, state_dict, max_model_len, num_blocks,
                                      consume_weights=consume_weights, stage=self.stages[0])
            child_config = replace(config, deterministic=self.runner.deterministic)
            for k in range(1, n):
                share = shares[k]
                cmd = [sys.executable, "-m", "pdserve.engine.pipeline", "--stage", str(k), "--store-port",
                       str(store.port), "--num-blocks", str(num_blocks), "--max-model-len-resolved",
                       str(max_model_len), *engine_argv(child_config, threads=len(share) if share else threads)]
                if share is not None:
                    cmd += ["--cores", ",".join(map(str, share))]
                self._procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
            self.links = self._connect(store)
        except BaseException:
            self.close()
            raise
        atexit.register(self.close)
        self._watch = threading.Thread(target=self._watch_stages, name="pdserve-stage-watch", daemon=True)
        self._watch.start()
        log.info("pipeline of %d stages up: layers %s, cores %s", n,
                 ", ".join(f"{s.start}-{s.end - 1}" for s in self.stages),
                 "; ".join(",".join(map(str, s)) if s else "shared" for s in shares))

    def _connect(self, store: Store) -> Links:
        """The process groups (they wait for every stage), then each stage's ready word."""
        result: list = []
        thread = threading.Thread(target=lambda: result.append(self._try_connect(store)), daemon=True)
        thread.start()
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while thread.is_alive():
            self._check_children("while starting")
            if time.monotonic() > deadline:
                raise PipelineBroken("pipeline stages did not connect in time")
            thread.join(0.05)
        if not result or isinstance(result[0], BaseException):
            raise PipelineBroken(f"pipeline stages did not connect: {result[0] if result else 'no answer'}")
        return result[0]

    def _try_connect(self, store):
        """The links, then each stage's ready word (it has loaded its weights); on a thread, while
        the caller watches the stages' processes (a gloo wait cannot be polled)."""
        try:
            links = connect(0, self.num_stages, 0, store)
            for k in range(1, self.num_stages):
                _recv(links.fwd, torch.zeros(1, dtype=torch.int64), k, f"stage {k} ready")
            return links
        except BaseException as exc:  # handed to the waiting thread
            return exc

    def _dead_stage(self) -> str | None:
        """Which stage has exited, and how (None: all run)."""
        for k, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None:
                return f"pipeline stage {k} exited with {code}"
        return None

    def _check_children(self, when: str) -> None:
        dead = self._dead_stage()
        if dead is not None:
            raise PipelineBroken(f"{dead} {when}")

    def _watch_stages(self) -> None:
        """Notice a stage's death even while no step waits on it (an idle worker leaves rotation)."""
        while not self._closed:
            dead = self._dead_stage()
            if dead is not None and not self._closed:
                self.broken = dead
                log.error("%s; the worker goes down with it", dead)
                return
            time.sleep(0.2)

    def check(self) -> None:
        """Raise PipelineBroken if a stage has died."""
        if self.broken is not None:
            raise PipelineBroken(self.broken)

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    # What the engine and the benchmarks read of a runner.
    def __getattr__(self, name: str):
        if name in ("dtype", "device", "cpu_linear", "deterministic", "kv_cache_resident", "backend",
                    "model", "sampler", "compiled_layers", "config"):
            return getattr(self.runner, name)
        raise AttributeError(name)

    # --- steps ---------------------------------------------------------------------------
    def submit(self, scheduled: list[ScheduledRequest]) -> MicroBatch:
        """Send a step down the pipeline: its plan to every stage, stage 0's layers, the hidden
        states on to stage 1. Returns at once after stage 0's layers."""
        self.check()
        step = self.runner.pack(scheduled)
        mb = self._ids = self._ids + 1
        header, body = encode_step(mb, step)
        fwd = self.links.fwd
        for k in range(2, self.num_stages):  # their hidden states come from the stage before
            self._post(fwd, header, k)
            self._post(fwd, as_bytes(body), k)
        started = time.monotonic()
        hidden = self.runner.forward(step)
        ended = time.monotonic()
        # Stage 1: the plan, the timings and the hidden states in one message after the header.
        self._post(fwd, header, 1)
        self._post(fwd, as_bytes(body, torch.zeros(self.num_stages, 2, dtype=torch.float64), hidden), 1)
        return MicroBatch(mb, step, started, ended, self._posted)

    def _post(self, group: dist.ProcessGroupGloo, tensor: torch.Tensor, dst: int) -> None:
        """Send without waiting (gloo sends once the peer takes it, in order per peer)."""
        try:
            self._sends.append((_send(group, tensor, dst), tensor))
        except RuntimeError as exc:
            raise PipelineBroken(f"pipeline link failed (send to stage {dst}): {exc}") from exc
        self._posted += 1

    def _retire(self, upto: int) -> None:
        """Wait for the sends posted before `upto`: every stage has taken them (done at once)."""
        while self._waited < upto and self._sends:
            _wait(self._sends.popleft()[0], "a send")
            self._waited += 1

    def collect(self, mb: MicroBatch) -> tuple[list[Request], SampleResult | None]:
        """Wait for a micro-batch's sampling rows from the last stage; the LM head and the
        sampler here. Micro-batches come back in the order they were submitted."""
        last = self.num_stages - 1
        step = mb.step
        n, h = len(step.sample_rows), self.model_config.hidden_size
        specs = [(torch.float64, (self.num_stages, 2)), (self.runner.dtype, (n, h))]
        size = self.num_stages * 2 * 8 + n * h * torch.empty((), dtype=self.runner.dtype).element_size()
        payload = _recv(self.links.fwd, torch.empty(size, dtype=torch.uint8), last, f"micro-batch {mb.id}")
        timings, rows_back = split_bytes(payload, *specs)
        rows = rows_back if n else None
        self._retire(mb.sent)
        head_start = time.monotonic()
        result = self.runner.sample(step, rows, rows_only=True) if rows is not None else ([], None)
        head_end = time.monotonic()
        tokens = step.num_tokens
        record = self.timeline.record
        record(Interval(0, mb.id, mb.started, mb.ended, "layers", tokens))
        for k in range(1, self.num_stages):
            start, end = timings[k].tolist()
            record(Interval(k, mb.id, start, end, "layers", tokens))
        if rows is not None:
            record(Interval(0, mb.id, head_start, head_end, "head", len(step.sample_rows)))
        return result

    def execute(self, scheduled: list[ScheduledRequest]) -> tuple[list[Request], SampleResult | None]:
        """One step through every stage, nothing else in flight (what a caller without
        micro-batches gets)."""
        return self.collect(self.submit(scheduled))

    # --- KV blocks across the stages -----------------------------------------------------
    def _command(self, kind: int, block_ids: BlockIds) -> torch.Tensor:
        ids = torch.as_tensor(block_ids, dtype=torch.long).reshape(-1).contiguous()
        header = torch.tensor([kind, ids.numel(), 0, 0, 0, 0, 0, 0], dtype=torch.int64)
        for k in range(1, self.num_stages):
            self._post(self.links.fwd, header, k)
            if ids.numel():
                self._post(self.links.fwd, ids, k)
        return ids

    def read_blocks(self, block_ids: BlockIds, out: torch.Tensor | None = None) -> torch.Tensor:
        """[L, 2, n, S, Hkv, D] of every layer: stage 0's own and each stage's, in layer order."""
        self.check()
        local = self.runner.read_blocks(block_ids)  # checks the ids first
        ids = self._command(READ, block_ids)
        parts = [local]
        for k in range(1, self.num_stages):
            s = self.stages[k]
            part = torch.empty((s.end - s.start, *local.shape[1:]), dtype=local.dtype)
            if ids.numel():
                _recv(self.links.kv, part, k, f"stage {k} KV read")
            parts.append(part)
        self._retire(self._posted)  # every stage answered: it took all that came before
        return torch.cat(parts, dim=0, out=out)

    def write_blocks(self, block_ids: BlockIds, payload: torch.Tensor) -> None:
        """Each stage's layers of `payload` into its cache (KVPayloadError before anything moves
        if it does not fit)."""
        self.check()
        if payload.dim() != 6 or payload.shape[0] != self.model_config.num_layers:
            raise KVPayloadError(f"payload is {list(payload.shape)}, expected {self.model_config.num_layers} layers")
        s0 = self.stages[0]
        self.runner.write_blocks(block_ids, payload[s0.start:s0.end])
        ids = self._command(WRITE, block_ids)
        for k in range(1, self.num_stages):
            s = self.stages[k]
            if ids.numel():
                self._post(self.links.kv, payload[s.start:s.end].contiguous(), k)

    # --- the end -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every stage (a STOP command, then a kill for one that does not go) and restore
        this process's cores."""
        if self._closed:
            return
        self._closed = True
        links = getattr(self, "links", None)
        if links is not None and self.broken is None:
            stop = torch.tensor([STOP, 0, 0, 0, 0, 0, 0, 0], dtype=torch.int64)
            for k, proc in enumerate(self._procs, start=1):
                if proc.poll() is None:
                    with contextlib.suppress(RuntimeError):
                        _send(links.fwd, stop, k)
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._affinity is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self._affinity)
            torch.set_num_threads(getattr(self, "_threads", torch.get_num_threads()))


# --- stages 1 .. N-1 --------------------------------------------------------------------------
def _die_with_parent() -> None:
    """SIGKILL this process when the one that started it dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def serve_stage(rank: int, runner: ModelRunner, links: Links, world: int, hidden_size: int) -> None:
    """The loop of a stage after the first: commands from stage 0, in order, until STOP."""
    fwd, kv = links.fwd, links.kv
    last = rank == world - 1
    timing_bytes = world * 2 * 8
    row_bytes = hidden_size * torch.empty((), dtype=runner.dtype).element_size()
    pending: deque = deque()  # sends not known done (their tensors stay alive with them)
    while True:
        header = _recv(fwd, torch.empty(HEADER, dtype=torch.int64), 0, "command")
        kind = int(header[0])
        # A gloo send says it is done only once waited on: wait for the old ones, which the next
        # stage took long ago (stage 0 keeps at most `world` micro-batches in flight).
        while len(pending) > 4 * world + 8:
            _wait(pending.popleft()[0], "a send")
        if kind == STOP:
            break
        if kind == STEP:
            body_bytes = step_body_size(header) * 8
            t = int(header[2])
            if rank == 1:  # plan, timings and hidden states in one message from stage 0
                payload = _recv(fwd, torch.empty(body_bytes + timing_bytes + t * row_bytes, dtype=torch.uint8), 0, "step")
                body, timings, hidden = split_bytes(payload, (torch.int64, (body_bytes // 8,)),
                                                    (torch.float64, (world, 2)), (runner.dtype, (t, hidden_size)))
            else:
                body = _recv(fwd, torch.empty(body_bytes, dtype=torch.uint8), 0, "step").view(torch.int64)
                payload = _recv(fwd, torch.empty(timing_bytes + t * row_bytes, dtype=torch.uint8), rank - 1,
                                "hidden states")
                timings, hidden = split_bytes(payload, (torch.float64, (world, 2)), (runner.dtype, (t, hidden_size)))
            step = decode_step(header, body)
            started = time.monotonic()
            out = runner.forward(step, hidden)
            if last:
                rows = step.sample_rows
                out = out if len(rows) == out.shape[0] else out[torch.frombuffer(rows, dtype=torch.int64)] if rows else out[:0]
            ended = time.monotonic()
            timings[rank, 0], timings[rank, 1] = started, ended
            message = as_bytes(timings, out)
            pending.append((_send(fwd, message, 0 if last else rank + 1), message))
            continue
        n = int(header[1])
        ids = _recv(fwd, torch.empty(n, dtype=torch.int64), 0, "block ids") if n else torch.empty(0, dtype=torch.int64)
        if not n:
            continue
        if kind == WRITE:
            cache = runner.kv_cache
            payload = torch.empty((cache.shape[0], 2, n, *cache.shape[3:]), dtype=cache.dtype)
            runner.write_blocks(ids, _recv(kv, payload, 0, "KV write"))
        elif kind == READ:
            part = runner.read_blocks(ids)
            pending.append((_send(kv, part, 0), part))
        else:
            raise PipelineBroken(f"unknown pipeline command {kind}")
    for work, _ in pending:
        with contextlib.suppress(RuntimeError):
            work.wait()


def main(argv: list[str] | None = None) -> int:
    _die_with_parent()
    p = argparse.ArgumentParser(prog="python -m pdserve.engine.pipeline",
                                description="one pipeline stage after the first (started by stage 0)")
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--num-blocks", type=int, required=True)
    p.add_argument("--max-model-len-resolved", type=int, required=True)
    p.add_argument("--cores", default="")
    p.add_argument("--log-level", default="INFO")
    add_engine_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s %(levelname)s stage {args.stage} %(name)s: %(message)s")
    if args.cores:
        os.sched_setaffinity(0, [int(c) for c in args.cores.split(",")])
    if args.threads:
        torch.set_num_threads(args.threads)
    config = engine_config(args)
    world = config.pipeline_parallel_size
    rank = args.stage
    links = connect(rank, world, args.store_port)
    from pdserve.model.weights import load_model

    loaded = load_model(config.model, single_use=True, keep=stage_weights(config, rank))
    stage = split_layers(loaded.config.num_layers, world, config.pp_layer_split)[rank]
    runner = ModelRunner(config, loaded.config, loaded.state_dict, args.max_model_len_resolved, args.num_blocks,
                         consume_weights=True, stage=stage)
    del loaded
    _wait(_send(links.fwd, torch.ones(1, dtype=torch.int64), 0), "ready")
    log.info("stage %d of %d: layers %d-%d, %d KV blocks", rank, world, stage.start, stage.end - 1, args.num_blocks)
    try:
        serve_stage(rank, runner, links, world, runner.model.config.hidden_size)
    except PipelineBroken as exc:
        log.info("stage %d: %s; exiting", rank, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
