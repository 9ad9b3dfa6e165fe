"""Everything behind the HTTP handlers: prompt building, sampling checks, routing, admission.

`RouterService` owns the registry, the control channel, the in-flight requests and the
metrics; it lives on the server's event loop and is started/stopped by the app's lifespan.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from pdserve.config.router import RouterConfig
from pdserve.protocol.messages import GenerateRequest, PrefillRequest
from pdserve.protocol.sampling import SamplingParams, SamplingParamsError, StructuredOutput
from pdserve.router.control import ControlServer
from pdserve.router.errors import APIError, bad_request, unavailable
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    completion_prompt,
    message_text,
    structured_output,
)
from pdserve.router.registry import Hasher, Registry, WorkerState
from pdserve.router.requests import Choice, RequestState, RequestTracker
from pdserve.router.tool_calls import ToolPlan, tool_plan
from pdserve.router.tracing import NO_TRACE, NoTrace
from pdserve.text import tools as tool_text
from pdserve.text.grammar import GrammarCompiler, GrammarError

log = logging.getLogger(__name__)

# Bodies larger than this are templated/tokenized (and block-hashed) off the event loop.
_INLINE_BODY_BYTES = 8192
# The longest text one token can stand for, when the tokenizer cannot tell (see max_token_chars).
_FALLBACK_MAX_TOKEN_CHARS = 128


class Slot:
    """One admitted HTTP request's place under --max-inflight, and the body bytes it holds under
    --max-buffered-body-bytes; `release` gives both back and is idempotent."""

    def __init__(self, service: RouterService) -> None:
        self._service: RouterService | None = service
        self.body_bytes = 0

    def hold_body(self, n: int) -> None:
        """Count `n` more body bytes against the router-wide budget, or refuse (503): past it,
        slow uploads would add up to the router's memory limit."""
        svc = self._service
        assert svc is not None, "hold_body after release"
        budget = svc.config.max_buffered_body_bytes
        if svc.buffered_body_bytes + n > budget:
            raise APIError(
                503,
                f"the router holds too many request bodies at once ({budget} bytes in all); retry shortly",
                code="body_budget_exceeded",
                headers={"Retry-After": "1"},
            )
        svc.buffered_body_bytes += n
        self.body_bytes += n

    def release(self) -> None:
        if self._service is not None:
            self._service.inflight -= 1
            self._service.buffered_body_bytes -= self.body_bytes
            self.body_bytes = 0
            self._service = None


class RouterService:
    """The router's state and the operations the HTTP layer needs. Event-loop owned."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: Any,
        *,
        detokenizer_factory: Callable[[Any], Any],
        hasher: Hasher | None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.detokenizer_factory = detokenizer_factory
        self.metrics = RouterMetrics()
        self.registry = Registry(hasher, config.kv_transport, config.prefill_fallback)
        self.tracker = RequestTracker()
        self.control = ControlServer(
            config.control_address,
            self.registry,
            self.tracker,
            self.metrics,
            config.heartbeat_timeout,
            on_lost=self._worker_lost,
        )
        self.inflight = 0
        self.buffered_body_bytes = 0  # bodies of admitted requests, received or arriving (Slot)
        self.draining = False
        self._api_key = config.api_key.encode() if config.api_key else None
        # Templating, tokenizing and hashing a big prompt take seconds: never on the loop.
        self._pool = ThreadPoolExecutor(
            max(1, config.tokenize_threads), thread_name_prefix="pdserve-tokenize"
        )
        # Grammars compile on their own threads: a request's tools may take seconds to compile
        # and must never hold up another request's tokenizing.
        self._grammar_pool = ThreadPoolExecutor(
            max(1, config.grammar_threads), thread_name_prefix="pdserve-grammar"
        )
        self.max_token_chars = max_token_chars(tokenizer)
        self.grammars = GrammarCompiler(tokenizer)
        self._hashes: tuple[Sequence[int], dict[int, list[bytes]]] | None = None
        if hasher is not None:
            self.registry.hasher = self._hash
        self._hasher = hasher

    async def start(self) -> None:
        await self.control.start()

    async def stop(self) -> None:
        """Fail what is still in flight (the drain is over) and close the control channel."""
        self.draining = True
        for state in self.tracker.all():
            state.fail(APIError(503, "the router is shutting down", code="shutting_down"))
        # Let the handlers see their failure and queue their aborts before the channel closes.
        deadline = time.monotonic() + 1.0
        while len(self.tracker) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await self.control.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    async def drain(self, timeout: float) -> None:
        """Stop admitting and wait (up to `timeout`) for in-flight requests to finish."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    # --- admission -----------------------------------------------------------------------

    def check_auth(self, authorization: str | None) -> None:
        if self._api_key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self._api_key
        ):
            raise APIError(
                401,
                "missing or invalid API key (send `Authorization: Bearer <key>`)",
                code="invalid_api_key",
            )

    def admit(self) -> Slot:
        if self.draining:
            raise APIError(503, "the router is shutting down", code="shutting_down")
        if self.inflight >= self.config.max_inflight:
            raise APIError(
                429,
                f"too many requests in flight (limit {self.config.max_inflight}); retry shortly",
                code="too_many_requests",
                headers={"Retry-After": "1"},
            )
        self.inflight += 1
        return Slot(self)

    def check_model(self, model: str) -> None:
        if model != self.config.served_model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.config.served_model_name!r}",
                param="model",
                code="model_not_found",
            )

    def context_length(self) -> int:
        workers = self.registry.max_model_len()
        lens = [n for n in (self.config.max_model_len, workers) if n is not None]
        if not lens:
            raise unavailable("no worker has registered yet; retry when /ready says 200")
        return min(lens)

    # --- prompt --------------------------------------------------------------------------

    async def prompt_ids(
        self, req: ChatCompletionRequest | CompletionRequest, body_bytes: int = 0
    ) -> tuple[list[int], str]:
        """Token ids of the request's prompt and the param that names it in errors.

        `body_bytes` (the request body's size) decides whether the work leaves the loop: it
        bounds the text, the tools and the template kwargs alike.
        """
        if isinstance(req, ChatCompletionRequest):
            chars = sum(len(message_text(m) or "") for m in req.messages)
            self._check_chars(chars, "messages")
            return await self._offload(body_bytes, self._chat_ids, req), "messages"
        prompt = completion_prompt(req)
        if isinstance(prompt, str):
            self._check_chars(len(prompt), "prompt")
            return await self._offload(body_bytes, self.tokenizer.encode, prompt), "prompt"
        vocab = self.tokenizer.vocab_size

        def first_bad() -> int | None:
            return next((t for t in prompt if not 0 <= t < vocab), None)

        bad = await self._offload(body_bytes, first_bad)
        if bad is not None:
            raise bad_request(
                f"token id {bad} in `prompt` is outside the vocabulary (size {vocab})", "prompt"
            )
        return prompt, "prompt"

    def _check_chars(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing, text that cannot fit: no token is longer than
        `max_token_chars`, so `chars` characters are at least chars / max_token_chars tokens."""
        ctx = self.context_length()
        if chars > ctx * self.max_token_chars:
            raise bad_request(
                f"the prompt has {chars} characters, more than the context length ({ctx} tokens) "
                f"can hold at {self.max_token_chars} characters per token at most",
                param,
                "context_length_exceeded",
            )

    async def _offload(self, size: int, fn: Callable[..., Any], *args: Any) -> Any:
        if size <= _INLINE_BODY_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def prefix_hashes(self, token_ids: Sequence[int]) -> None:
        """Hash a long prompt's blocks off the loop, for every block size the workers use, so
        that routing (on the loop) finds them ready. The next `submit` consumes them."""
        if self._hasher is None or len(token_ids) * 8 <= _INLINE_BODY_BYTES:
            return
        sizes = sorted({w.block_size for w in self.registry.workers.values()})
        hasher = self._hasher

        def work() -> dict[int, list[bytes]]:
            return {bs: hasher(token_ids, bs) for bs in sizes}

        by_size = await asyncio.get_running_loop().run_in_executor(self._pool, work)
        self._hashes = (token_ids, by_size)

    def _hash(self, token_ids: Sequence[int], block_size: int) -> list[bytes]:
        ready = self._hashes
        if ready is not None and ready[0] is token_ids and block_size in ready[1]:
            return ready[1][block_size]
        assert self._hasher is not None
        return self._hasher(token_ids, block_size)

    def _chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        messages = []
        for m in req.messages:
            # Only an assistant message may have no content (parse_request checked).
            msg: dict[str, Any] = {"role": m.role, "content": message_text(m) or ""}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                msg["tool_calls"] = [msgspec.to_builtins(c) for c in m.tool_calls]
            messages.append(msg)
        kwargs = dict(req.chat_template_kwargs or {})
        plan = tool_plan(req)
        if tool_text.template_supports_tools(getattr(self.tokenizer, "chat_template", None)):
            messages = tool_text.for_template(messages)
            if plan is not None:
                kwargs["tools"] = [f.as_tool() for f in plan.functions]
        else:  # the default format (docs/tools.md)
            functions = plan.functions if plan is not None else ()
            instruction = plan.instruction() if plan is not None else ""
            messages = tool_text.render_default(messages, functions, instruction)
        try:
            # Special tokens come from the template's markup only, never from the messages'
            # text or the kwargs (text/tokenizer.py `encode_chat`).
            return self.tokenizer.encode_chat(messages, add_generation_prompt=True, **kwargs)
        except Exception as exc:  # ValueError, jinja2 errors: the template rejected these messages
            raise bad_request(
                f"the chat template failed on these messages: {exc}",
                "messages",
                "chat_template_error",
            ) from None

    # --- structured outputs --------------------------------------------------------------

    async def structured_output(
        self, req: ChatCompletionRequest | CompletionRequest
    ) -> StructuredOutput | None:
        """The request's output constraint, compiled here once so that a bad one is a 400 naming
        its parameter before any worker sees it. Compilation runs on the thread pool under
        `grammar_timeout` (llguidance's own fuel limits bound the thread's work).

        Every tool's `parameters` is compiled too, and `tool_choice` "required" or a named
        function is itself a constraint: the grammar of the calls (router/tool_calls.py)."""
        found = structured_output(req)
        plan = self.tool_plan(req)
        if plan is not None:
            await self._compile(plan.parameter_specs(), "tools")
            forced = plan.constraint()
            if forced is not None:
                if found is not None:
                    raise bad_request(
                        f"`tool_choice` {plan.choice!r} constrains the output to tool calls; "
                        f"it cannot be combined with `{found[1]}`",
                        found[1],
                    )
                found = (forced, "tool_choice")
        if found is None:
            return None
        await self._compile([found], found[1])
        return found[0]

    async def _compile(self, specs: list[tuple[StructuredOutput, str]], what: str) -> None:
        """Compile constraints on the grammar pool; the first that fails is a 400 naming its field.

        `grammar_timeout` counts compile time only, from when a thread takes the work (time
        queued behind other requests' grammars is not this request's fault). Past it, or when
        the request goes away, the thread stops before the next constraint: one request holds a
        thread for at most the timeout plus one constraint (each bounded by the limits and
        llguidance's fuel, text/grammar.py)."""
        loop = asyncio.get_running_loop()
        started = asyncio.Event()
        stop = threading.Event()

        def check_all() -> tuple[str, GrammarError] | None:
            loop.call_soon_threadsafe(started.set)
            for spec, param in specs:
                if stop.is_set():
                    return None
                try:
                    self.grammars.check(spec)
                except GrammarError as exc:
                    return param, exc
            return None

        work = loop.run_in_executor(self._grammar_pool, check_all)
        began = asyncio.ensure_future(started.wait())
        try:
            waiters: list[asyncio.Future[Any]] = [work, began]
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            failed = await asyncio.wait_for(asyncio.shield(work), self.config.grammar_timeout)
        except TimeoutError:
            raise bad_request(
                f"`{what}` took more than {self.config.grammar_timeout:g} s to compile; simplify it",
                what,
                "invalid_structured_output",
            ) from None
        finally:
            began.cancel()
            if not work.done():  # timed out, or the request was cancelled: free the thread
                stop.set()
                work.cancel()
        if failed is not None:
            param, exc = failed
            raise bad_request(f"invalid `{param}`: {exc}", param, "invalid_structured_output")

    def tool_plan(self, req: ChatCompletionRequest | CompletionRequest) -> ToolPlan | None:
        """The request's tools when its output is parsed for calls (None: plain content)."""
        return tool_plan(req) if isinstance(req, ChatCompletionRequest) else None

    # --- sampling ------------------------------------------------------------------------

    def sampling_params(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        prompt_len: int,
        prompt_param: str,
        structured: StructuredOutput | None = None,
    ) -> list[SamplingParams]:
        """One validated SamplingParams per choice (seed + i when a seed is given);
        `structured` is the request's compiled constraint (`structured_output`)."""
        ctx = self.context_length()
        if prompt_len >= ctx:
            raise bad_request(
                f"the prompt has {prompt_len} tokens but the context length is {ctx}",
                prompt_param,
                "context_length_exceeded",
            )
        names = {}
        if isinstance(req, ChatCompletionRequest):
            max_tokens = (
                req.max_completion_tokens
                if req.max_completion_tokens is not None
                else req.max_tokens
            )
            if req.max_completion_tokens is not None:
                names["max_tokens"] = "max_completion_tokens"
            names["logprobs"] = "top_logprobs"
            default_max = ctx - prompt_len
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            max_tokens, default_max, logprobs = (
                req.max_tokens,
                min(16, ctx - prompt_len),
                req.logprobs,
            )
        stop_ids = list(req.stop_token_ids or ())
        if not req.ignore_eos:
            stop_ids += list(self.tokenizer.stop_token_ids)
        proto = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
            presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
            max_tokens=default_max if max_tokens is None else max_tokens,
            min_tokens=req.min_tokens,
            stop_token_ids=tuple(dict.fromkeys(stop_ids)),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            structured=structured,
        )
        params = []
        for i in range(req.n):
            seed = None if req.seed is None else req.seed + i
            try:
                params.append(
                    msgspec.structs.replace(proto, seed=seed).validate(self.tokenizer.vocab_size)
                )
            except SamplingParamsError as exc:
                param = names.get(exc.param, exc.param)
                raise bad_request(str(exc).replace(exc.param, param, 1), param) from None
        if prompt_len + params[0].max_tokens > ctx:
            raise bad_request(
                f"the prompt ({prompt_len} tokens) plus max_tokens ({params[0].max_tokens}) exceeds "
                f"the context length ({ctx}); shorten the prompt or lower max_tokens",
                prompt_param,
                "context_length_exceeded",
            )
        return params

    # --- dispatch ------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: list[SamplingParams],
        stops: Sequence[str],
        want_logprobs: bool,
        arrival: float,
        trace: NoTrace = NO_TRACE,
    ) -> RequestState:
        """Pick workers for every choice and send the work; 503 when no path exists."""
        if self.draining:
            raise APIError(503, "the router is shutting down", code="shutting_down")
        choices: list[Choice] = []
        token_ids = tuple(prompt_ids)
        ready, self._hashes = self._hashes, None
        if ready is not None and ready[0] is prompt_ids:
            self._hashes = (token_ids, ready[1])
        try:
            for i, sp in enumerate(params):
                sub_id = f"{request_id}-{i}"
                route = self.registry.pick(sub_id, token_ids, sp.max_tokens)
                if route is None:
                    for c in choices:
                        self.control.abort(c.route.workers, (c.request_id,))
                        self.registry.forget_request(c.request_id, c.route.workers)
                    raise unavailable(
                        "no worker can serve this request now (need a prefill and a decode worker, or a colocated one)"
                    )
                choices.append(
                    Choice(i, sub_id, route, self.detokenizer_factory(self.tokenizer), stops, sp)
                )
        finally:
            self._hashes = None
        state = RequestState(
            request_id,
            choices,
            prompt_tokens=len(token_ids),
            want_logprobs=want_logprobs,
            timeout=self.config.request_timeout,
            metrics=self.metrics,
            send_abort=self.control.abort,
            on_close=self._forget,
            arrival=arrival,
            retry=self._retry,
        )
        state.prompt_ids = token_ids
        state.trace = trace
        self.tracker.add(state)
        now = time.time()
        for c, sp in zip(choices, params, strict=True):
            r = c.route
            self._send_work(c, token_ids, sp, now, trace=trace)
            self.metrics.request_started()
            log.info(
                "request %s: %d prompt tokens, max_tokens %d -> %s%s (%s)",
                c.request_id,
                len(token_ids),
                sp.max_tokens,
                r.first,
                f" -> {r.decode} via {r.kv_transport}" if r.decode else "",
                r.mode,
            )
        self.metrics.queue_time.observe(time.monotonic() - arrival)
        return state

    def _send_work(self, c: Choice, token_ids: tuple[int, ...], sp: SamplingParams, now: float,
                   generated: tuple[int, ...] = (), trace: NoTrace = NO_TRACE) -> None:
        r = c.route
        trace_context = trace.dispatch(c)
        if r.mode == "disaggregated":
            assert r.decode is not None
            msg: PrefillRequest | GenerateRequest = PrefillRequest(
                request_id=c.request_id, token_ids=token_ids, sampling=sp, decode_worker_id=r.decode,
                decode_kv_address=r.decode_kv_address, kv_transport=r.kv_transport, arrival_time=now,
                output_token_ids=generated, trace_context=trace_context,
            )
        else:
            msg = GenerateRequest(request_id=c.request_id, token_ids=token_ids, sampling=sp, arrival_time=now,
                                  output_token_ids=generated, trace_context=trace_context)
        self.control.send(r.first, msg)

    def _worker_lost(self, w: WorkerState, message: str) -> int:
        """Re-dispatch each unfinished choice the lost worker held (prompt + the tokens already
        streamed, up to --migration-limit times); fail the requests that cannot go on. Returns
        how many requests failed."""
        failed: dict[int, RequestState] = {}
        for state, choice in self.tracker.affected(w.worker_id):
            if id(state) in failed:
                continue
            cause = f"{w.role}_lost_{'before' if choice.first_token_at is None else 'after'}_first_token"
            if self._migrate(state, choice, cause, avoid=(w.worker_id,)):
                continue
            failed[id(state)] = state
            log.warning("request %s: %s", state.request_id, message)
            state.fail(APIError(502, f"{message}; request {state.request_id} cannot finish", code="worker_lost"))
        return len(failed)

    def _retry(self, state: RequestState, choice: Choice, worker_id: str, cause: str) -> bool:
        """A worker gave the choice up for a reason of its own: it refused the work, or the KV
        hand-off failed or outlived its lease. Send it elsewhere, avoiding (where another path
        exists) the refusing worker, or the decode worker of the failed hand-off: the prefill
        side recomputes the prompt from its prefix cache, so keeping it costs little."""
        culprit = choice.route.decode if cause.startswith("kv_") and choice.route.decode else worker_id
        return self._migrate(state, choice, cause, avoid=(culprit,))

    def _migrate(self, state: RequestState, choice: Choice, cause: str, avoid: Sequence[str] = ()) -> bool:
        sp = choice.sampling
        if sp is None or choice.migrations >= self.config.migration_limit or self.draining:
            return False
        generated = tuple(choice.token_ids)
        tokens = state.prompt_ids + generated
        new_id = f"{choice.base_id}~{choice.migrations + 1}"
        route = self.registry.pick(new_id, tokens, max(1, sp.max_tokens - len(generated)), avoid)
        if route is None:
            return False
        old_id, old = choice.redispatch(route)
        self.control.abort(old.workers, (old_id,))  # whoever survives of the old pair lets go
        self.tracker.rekey(old_id, choice.request_id)
        self.registry.forget_request(old_id, old.workers)
        state.trace.migration(choice, cause, old, old_id)
        self._send_work(choice, state.prompt_ids, sp, time.time(), generated, trace=state.trace)
        self.metrics.migrations.labels(cause).inc()
        log.warning("request %s: re-dispatched (%s) after %d tokens: %s -> %s", choice.request_id, cause,
                    len(generated), "/".join(old.workers), "/".join(route.workers))
        return True

    def _forget(self, state: RequestState) -> None:
        self.tracker.remove(state)
        for c in state.choices:
            self.registry.forget_request(c.request_id, c.route.workers)


def max_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token decodes to, from the vocabulary if it is
    readable (byte-level spellings: one vocabulary character per byte, so never fewer)."""
    backend = getattr(tokenizer, "backend", None)
    try:
        vocab = backend.get_vocab(with_added_tokens=True) if backend is not None else None
    except Exception:  # a backend without get_vocab: fall back to the documented bound
        vocab = None
    if not vocab:
        return _FALLBACK_MAX_TOKEN_CHARS
    return max(max(len(t) for t in vocab), 1)
