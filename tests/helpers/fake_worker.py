"""Test doubles for the router: a scripted worker on the real control channel, a toy tokenizer,
and a harness that runs the router app under uvicorn on 127.0.0.1 in a background thread.

`FakeWorker` speaks through the real `WorkerLink`. As "colocated" it emits a script of token ids
itself; as a "prefill" + "decode" pair it emits the first token from the prefill worker and hands
the rest to the decode worker named in the PrefillRequest (through an in-process `KVBus` that
stands in for the KV transfer), as the real workers do.
"""

from __future__ import annotations

import collections
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import uvicorn

from pdserve.config.router import RouterConfig
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.block_hash import hash_blocks
from pdserve.protocol.messages import (
    Abort,
    GenerateRequest,
    Heartbeat,
    ModelFingerprint,
    PrefillRequest,
    Register,
    TokenEvent,
    TokenEvents,
)
from pdserve.router.app import create_app
from pdserve.router.http_server import EdgeLimits, server_config
from pdserve.worker.router_link import Fence, WorkerLink

# --- a toy tokenizer -------------------------------------------------------------------------

PIECES = ("Hel", "lo", " wor", "ld", "END", "<|", "|>", " the", "\u2028", "\u2029")
EOS = 256


class FakeTokenizer:
    """ids 0-255: one latin-1 character each; 256: <eos>; 257+: the multi-character PIECES."""

    eos_token_id = EOS
    stop_token_ids = (EOS,)
    vocab_size = 257 + len(PIECES)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            for j, piece in enumerate(PIECES):
                if text.startswith(piece, i):
                    ids.append(257 + j)
                    i += len(piece)
                    break
            else:
                ids.append(ord(text[i]) if ord(text[i]) < 256 else ord("?"))
                i += 1
        return ids

    def token_to_piece(self, token_id: int) -> str:
        if token_id == EOS:
            return "<eos>"
        return PIECES[token_id - 257] if token_id > EOS else chr(token_id)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(
            "" if (t == EOS and skip_special_tokens) else self.token_to_piece(t) for t in ids
        )

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        if any("RAISE" in (m.get("content") or "") for m in messages):
            raise ValueError("the template refuses this conversation")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs))


class FakeDetokenizer:
    def __init__(self, tokenizer: FakeTokenizer) -> None:
        self.tokenizer = tokenizer

    def push(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def flush(self) -> str:
        return ""


def toks(text: str) -> list[int]:
    return FakeTokenizer().encode(text)


# --- the fake worker -------------------------------------------------------------------------

FINGERPRINT = ModelFingerprint("fake", "llama", 2, 1, 4, "float32", 16)


class KVBus:
    """Stands in for the KV transfer: prefill workers post hand-offs, decode workers take them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_worker: dict[str, collections.deque] = collections.defaultdict(collections.deque)

    def post(self, decode_worker_id: str, item: tuple) -> None:
        with self._lock:
            self._by_worker[decode_worker_id].append(item)

    def take(self, worker_id: str) -> list[tuple]:
        with self._lock:
            q = self._by_worker[worker_id]
            out = list(q)
            q.clear()
        return out


@dataclass
class _Emission:
    request_id: str
    tokens: list[int]
    finish: str
    position: int
    due: float
    num_prompt_tokens: int
    logprobs: int | None
    prefill_handoff: PrefillRequest | None = None  # prefill: post to the bus after the token
    sent: int = 0


@dataclass
class FakeWorker:
    """A scripted worker. `script(prompt_ids) -> token ids` (or a fixed list) is what it says."""

    router_address: str
    worker_id: str
    role: str = "colocated"
    script: Callable[[Sequence[int]], list[int]] | list[int] = field(
        default_factory=lambda: toks("Hello world")
    )
    delay: float = 0.0  # between tokens
    first_delay: float = 0.0
    bus: KVBus | None = None
    num_blocks: int = 1000
    max_model_len: int = 4096
    host_id: str = ""
    kv_transports: tuple[str, ...] = ("tcp",)
    heartbeat_interval: float = 0.05
    queued_prefill_tokens: int = 0
    free_blocks: int | None = None
    kv_resident: bool = True  # heartbeats say so (a real worker: its KV cache faulted in)
    received: list = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)
    fences: list = field(default_factory=list)
    auth: FrameAuth | None = None
    refuse: int = 0  # the next `refuse` requests get a retryable refusal with cause `refuse_cause`
    refuse_cause: str = "refused"
    kv_refuse: int = 0  # decode: the next `kv_refuse` KV hand-offs fail (retry cause kv_failed)

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        self._active: dict[str, _Emission] = {}
        self._stop = threading.Event()
        self.hung = False
        register = Register(
            worker_id=self.worker_id,
            role=self.role,
            kv_address=f"tcp://127.0.0.1:1{len(self.worker_id)}" if self.role != "prefill" else "",
            fingerprint=FINGERPRINT,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            kv_transports=self.kv_transports,
            host_id=self.host_id,
        )
        self.link = WorkerLink(
            self.router_address, register, self._heartbeat, self.heartbeat_interval, auth=self.auth
        )
        self._thread = threading.Thread(
            target=self._loop, name=f"fake-{self.worker_id}", daemon=True
        )

    def start(self, timeout: float = 5.0) -> FakeWorker:
        self.link.start()
        self._thread.start()
        assert self.link.wait_registered(timeout), f"{self.worker_id} did not register"
        return self

    def stop(self, goodbye: bool = True) -> None:
        self._stop.set()
        self._thread.join(2)
        if goodbye:
            self.link.close()

    def hang(self) -> None:
        """Stop heartbeating and emitting, as a wedged process would (the socket stays up)."""
        self.hung = True

    # --- waiting helpers for tests -------------------------------------------------------

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def requests(self) -> list[PrefillRequest | GenerateRequest]:
        with self._cond:
            return [m for m in self.received if isinstance(m, PrefillRequest | GenerateRequest)]

    # --- the engine loop -----------------------------------------------------------------

    def _heartbeat(self) -> Heartbeat:
        if self.hung:
            raise RuntimeError("hung (test)")
        free = self.num_blocks if self.free_blocks is None else self.free_blocks
        return Heartbeat(
            worker_id=self.worker_id,
            free_blocks=free,
            total_blocks=self.num_blocks,
            queued_prefill_tokens=self.queued_prefill_tokens,
            running=len(self._active),
            waiting=0,
            kv_resident=self.kv_resident,
        )

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.hung:
                for msg in self.link.poll():
                    self._handle(msg)
                if self.bus is not None:
                    for item in self.bus.take(self.worker_id):
                        self._start_decode(*item)
                self._emit_due()
            time.sleep(0.001)

    def _handle(self, msg) -> None:
        if isinstance(msg, Fence):  # the router changed: what the old one gave us is dropped
            with self._cond:
                self.fences.append(msg)
                self._active.clear()
                self._cond.notify_all()
            return
        with self._cond:
            self.received.append(msg)
            if isinstance(msg, Abort):
                self.aborted.update(msg.request_ids)
                for rid in msg.request_ids:
                    self._active.pop(rid, None)
            self._cond.notify_all()
        if isinstance(msg, GenerateRequest | PrefillRequest) and self.refuse > 0:
            self.refuse -= 1
            self._fail(msg.request_id, "refused (test)", self.refuse_cause)
        elif isinstance(msg, GenerateRequest | PrefillRequest):
            tokens, finish = self._plan(msg.token_ids, msg.sampling)
            now = time.monotonic()
            if isinstance(msg, PrefillRequest):
                done = len(tokens) == 1
                self._active[msg.request_id] = _Emission(
                    msg.request_id,
                    tokens[:1],
                    finish if done else "",
                    0,
                    now + self.first_delay,
                    len(msg.token_ids),
                    msg.sampling.logprobs,
                    None if done else msg,
                )
            else:
                self._active[msg.request_id] = _Emission(
                    msg.request_id,
                    tokens,
                    finish,
                    0,
                    now + self.first_delay,
                    len(msg.token_ids),
                    msg.sampling.logprobs,
                )

    def _plan(self, prompt: Sequence[int], sampling) -> tuple[list[int], str]:
        script = self.script(prompt) if callable(self.script) else list(self.script)
        out: list[int] = []
        for t in script:
            out.append(t)
            if t in sampling.stop_token_ids and not sampling.ignore_eos:
                return out, "stop"
            if len(out) == sampling.max_tokens:
                return out, "length"
        return out, "stop"

    def _fail(self, request_id: str, message: str, retry: str) -> None:
        ev = TokenEvent(request_id=request_id, token_ids=(), finish_reason="error", error=message, retry=retry)  # type: ignore[arg-type]
        self.link.send_events(TokenEvents(worker_id=self.worker_id, events=(ev,)))

    def _start_decode(self, req: PrefillRequest, first_token: int) -> None:
        tokens, finish = self._plan(req.token_ids, req.sampling)
        with self._cond:
            self.received.append(("kv", req.request_id))
            if req.request_id in self.aborted:
                return
            if self.kv_refuse > 0:
                self.kv_refuse -= 1
                self._fail(req.request_id, "KV transfer refused: checksum mismatch (test)", "kv_failed")
                return
            self._active[req.request_id] = _Emission(
                req.request_id,
                tokens[1:],
                finish,
                1,
                time.monotonic() + self.delay,
                0,
                req.sampling.logprobs,
            )

    def _emit_due(self) -> None:
        now = time.monotonic()
        events = []
        for rid, em in list(self._active.items()):
            if now < em.due:
                continue
            t = em.tokens[em.sent]
            em.sent += 1
            last = em.sent == len(em.tokens)
            lp = None if em.logprobs is None else (-0.5,)
            top = (
                None
                if em.logprobs is None
                else (tuple((t + k, -0.5 - k) for k in range(em.logprobs)),)
            )
            events.append(
                TokenEvent(
                    request_id=rid,
                    token_ids=(t,),
                    logprobs=lp,
                    top_logprobs=top,
                    finish_reason=(em.finish or None) if last else None,
                    num_prompt_tokens=em.num_prompt_tokens if em.position + em.sent == 1 else 0,
                    position=em.position + em.sent - 1,
                )
            )
            em.due = now + self.delay
            if last:
                del self._active[rid]
                if em.prefill_handoff is not None and self.bus is not None:
                    self.bus.post(em.prefill_handoff.decode_worker_id, (em.prefill_handoff, t))
        if events:
            self.link.send_events(TokenEvents(worker_id=self.worker_id, events=tuple(events)))


# --- the router under uvicorn ----------------------------------------------------------------


class RouterHarness:
    """The real router app on 127.0.0.1:<free port> with a control socket on a free port."""

    def __init__(self, tokenizer=None, auth: FrameAuth | None = None, model_name: str | None = None,
                 edge: EdgeLimits | None = None, **config) -> None:
        config.setdefault("control_address", "tcp://127.0.0.1:*")
        config.setdefault("served_model_name", "fake-model")
        config.setdefault("heartbeat_timeout", 1.0)
        config.setdefault("drain_timeout", 0.2)
        config.setdefault("request_timeout", 10.0)
        self.tokenizer = tokenizer or FakeTokenizer()
        detok = FakeDetokenizer if isinstance(self.tokenizer, FakeTokenizer) else None
        kwargs = {"detokenizer_factory": detok} if detok else {}
        self.app = create_app(RouterConfig(**config), self.tokenizer, hasher=hash_blocks, **kwargs)
        self.service = self.app.state.service
        self.auth = auth
        if auth is not None or model_name is not None:
            self.service.control.configure(auth=auth or FrameAuth(None), model_name=model_name)
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            server_config(
                self.app, edge or EdgeLimits(), log_level="warning", timeout_graceful_shutdown=2
            )
        )
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self.workers: list[FakeWorker] = []
        self.bus = KVBus()

    def __enter__(self) -> RouterHarness:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "router did not start"
            time.sleep(0.01)
        self.control_address = self.service.control.bound_address
        return self

    def __exit__(self, *exc) -> None:
        for w in self.workers:
            w.stop()
        self.server.should_exit = True
        self._thread.join(10)
        self._sock.close()

    def worker(self, worker_id: str, role: str = "colocated", **kw) -> FakeWorker:
        kw.setdefault("bus", self.bus)
        kw.setdefault("auth", self.auth)
        w = FakeWorker(self.control_address, worker_id, role, **kw).start()
        self.workers.append(w)
        # A loaded CI machine has taken over 5 s to register one: wait long, and fail here, not
        # with a 503 from the test's first request.
        if not self.wait_until(lambda: worker_id in self.service.registry.workers, timeout=30.0):
            raise TimeoutError(f"fake worker {worker_id} did not register within 30 s")
        return w

    @staticmethod
    def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True
