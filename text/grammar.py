"""Structured outputs: a `StructuredOutput` compiled with llguidance into a per-request matcher.

The router compiles every constraint once to refuse a bad one (a 400 naming its parameter) before
any worker sees it; each worker compiles it again, under the same limits, to mask its logits. A
matcher knows only the output tokens it consumed, so the decode worker rebuilds the prefill
worker's state by consuming the tokens that came with the KV (docs/structured_outputs.md).

Nothing here raises anything but `GrammarError` for a constraint, however malformed: llguidance
reports grammar errors as values, and a Rust panic (pyo3's PanicException, a BaseException) is
turned into a GrammarError too, so a bad grammar fails its request, never the process.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import llguidance as llg

from pdserve.protocol.sampling import MAX_STRUCTURED_BYTES, StructuredOutput
from pdserve.text.json_grammar import schema_grammar

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

MAX_SCHEMA_DEPTH = 32  # nesting of objects and arrays in a JSON schema document
MAX_PATTERN_CHARS = 4096  # a regex
MAX_NESTING = 32  # brackets inside a regex or a grammar
MAX_CHOICES = 512
# Properties of one object in a schema. Each optional property adds ~4 items to an Earley row and
# llguidance refuses a row over 2000 items at the step that reaches it (3,000 optional properties
# compiled, then failed at the first token): past this cap a schema is refused before it compiles.
MAX_PROPERTIES = 256
# Keywords that document a schema without constraining it: left out of what is compiled and of the
# cache key, so that a new title or description does not compile the same grammar again.
_ANNOTATIONS = frozenset({"title", "description", "$comment", "examples"})
# Where a schema holds subschemas: a map of them, a list of them, or one.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_SCHEMA_ONE = frozenset({"items", "additionalProperties", "not", "if", "then", "else", "contains",
                         "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalItems"})
_MAX_MESSAGE = 400

# JSON is generated compact (no whitespace between tokens): flexible whitespace lets a model pad
# forever with newlines and spaces, the classic runaway of small models under a JSON grammar.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


def parser_limits() -> llg.LLParserLimits:
    """llguidance's work budgets, below its defaults: they bound compile time (lexer fuel, grammar
    size) and every mask computation (step fuel and items), whatever the grammar."""
    return llg.LLParserLimits(
        # Regex analysis when the lexer is built (the first mask): 50k is ~50 ms. It is what stops
        # nested counted repetitions such as (a{1000}){1000}, which take seconds at the default.
        initial_lexer_fuel=50_000,
        step_lexer_fuel=50_000,  # a few ms per token mask at most
        step_max_items=20_000,
        max_lexer_states=50_000,
        max_grammar_size=100_000,
        verbose_errors=False,  # messages go back to clients: no parser state dumps
    )


class GrammarError(ValueError):
    """A constraint that is malformed, unsupported, over a limit, or cannot be satisfied."""


def _short(message: str) -> str:
    first = message.strip().splitlines()[0] if message.strip() else "invalid grammar"
    return first if len(first) <= _MAX_MESSAGE else first[: _MAX_MESSAGE - 3] + "..."


def _guarded(fn, *args):
    """Call into llguidance; any failure, a Rust panic included, becomes a GrammarError."""
    try:
        return fn(*args)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - PanicException derives from BaseException
        raise GrammarError(_short(str(exc)) or type(exc).__name__) from None


def json_depth(value: Any) -> int:
    """How deeply objects and arrays nest in a decoded JSON value (iterative: no recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            if depth > MAX_SCHEMA_DEPTH:
                return depth
            todo.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


def bracket_depth(text: str) -> int:
    """The deepest nesting of (), [] and {} in a pattern or grammar, skipping escaped characters."""
    depth = deepest = 0
    escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}":
            depth = max(0, depth - 1)
    return deepest


def widest_object(value: Any) -> int:
    """The most properties any object of a schema declares (iterative: no recursion)."""
    widest, todo = 0, [value]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                widest = max(widest, len(props))
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return widest


def schema_meaning(value: Any) -> Any:
    """A copy of a JSON schema without its annotations (`_ANNOTATIONS`) where a schema keyword
    stands (a property named "title" stays): the same constraint, whatever its documentation."""
    if not isinstance(value, dict):
        return value
    out: dict[str, Any] = {}
    for key, sub in value.items():
        if key in _ANNOTATIONS:
            continue
        if key in _SCHEMA_MAPS and isinstance(sub, dict):
            out[key] = {k: schema_meaning(v) for k, v in sub.items()}
        elif key in _SCHEMA_LISTS and isinstance(sub, list):
            out[key] = [schema_meaning(v) for v in sub]
        elif key in _SCHEMA_ONE:
            out[key] = [schema_meaning(v) for v in sub] if isinstance(sub, list) else schema_meaning(sub)
        else:
            out[key] = sub
    return out


def check_limits(spec: StructuredOutput) -> Any:
    """Refuse a constraint over the size, depth or complexity caps (GrammarError); return the
    decoded value of a JSON spec (a schema, the choices), None for text specs."""
    size = len(spec.spec.encode())
    if size > MAX_STRUCTURED_BYTES:
        raise GrammarError(f"the constraint has {size} bytes; the limit is {MAX_STRUCTURED_BYTES}")
    if spec.kind in ("json_schema", "choice"):
        try:
            value = json.loads(spec.spec)
        except RecursionError:
            raise GrammarError(f"nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
        except ValueError as exc:
            raise GrammarError(f"is not valid JSON: {exc}") from None
        if json_depth(value) > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if spec.kind == "json_schema" and not isinstance(value, dict | bool):
            raise GrammarError("a JSON schema must be an object")
        if spec.kind == "json_schema" and (wide := widest_object(value)) > MAX_PROPERTIES:
            raise GrammarError(f"an object of the schema has {wide} properties; the limit is {MAX_PROPERTIES}")
        if spec.kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise GrammarError("the choices must be a non-empty list of strings")
            if len(value) > MAX_CHOICES:
                raise GrammarError(f"has {len(value)} choices; the limit is {MAX_CHOICES}")
        return value
    if spec.kind == "regex" and len(spec.spec) > MAX_PATTERN_CHARS:
        raise GrammarError(f"the pattern has {len(spec.spec)} characters; the limit is {MAX_PATTERN_CHARS}")
    if spec.kind in ("regex", "grammar"):
        if not spec.spec:
            raise GrammarError(f"the {spec.kind} is empty")
        if bracket_depth(spec.spec) > MAX_NESTING:
            raise GrammarError(f"nests brackets deeper than {MAX_NESTING} levels")
    return None


def prepare(spec: StructuredOutput) -> tuple[tuple[str, str], Any]:
    """Check a constraint's limits (GrammarError); return its meaning's cache key and its decoded
    value (a schema without annotations, the choices; None for text specs)."""
    value = check_limits(spec)
    if spec.kind == "json_schema" and isinstance(value, dict):
        value = schema_meaning(value)
        return (spec.kind, json.dumps(value, separators=(",", ":"), ensure_ascii=False)), value
    return (spec.kind, spec.spec), value


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of a constraint (not yet checked against a tokenizer)."""
    return _grammar_of(spec, prepare(spec)[1])


def _grammar_of(spec: StructuredOutput, value: Any) -> str:
    if spec.kind in ("json_object", "json_schema"):
        # Numbers bounded to what a double holds (text/json_grammar.py); a schema the rewrite
        # does not know compiles as it is.
        schema = {"type": "object"} if spec.kind == "json_object" else value
        lark = schema_grammar(schema)
        if lark is not None:
            return _guarded(llg.LLMatcher.grammar_from_lark, lark)
        return _guarded(lambda: llg.LLMatcher.grammar_from_json_schema(value, defaults=_JSON_OPTIONS))
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.spec)
    if spec.kind == "choice":
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    return _guarded(llg.grammar_from, "grammar", spec.spec)  # Lark, or GBNF converted to Lark


def llg_tokenizer(tok: Any) -> llg.LLTokenizer:
    """llguidance's view of a tokenizer: every token's bytes, the special ones, the EOS set.

    llguidance reads a tokenizer.json's added tokens of the form `<...>` as special whatever
    their flag, so Qwen's `<tool_call>` or `<think>` (added, not special: text the detokenizer
    keeps) would be a token no grammar can write, yet the one its tokenization of the text
    `<tool_call>` yields: the grammar of calls would allow only that token and then refuse it.
    For such a vocabulary llguidance gets the token bytes itself, with our special flags."""
    eos = list(tok.stop_token_ids) or [tok.eos_token_id]
    base = llg.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=eos)
    added = tok.backend.get_added_tokens_decoder()
    misread = [i for i, t in added.items() if not t.special and base.is_special_token(i)]
    if not misread:
        return base
    vocabulary = _Vocabulary(tok, [
        added[i].content.encode() if i in added else base.decode_bytes([i]) for i in range(tok.vocab_size)
    ], [i for i, t in added.items() if t.special])
    return llg.LLTokenizer(llg.TokenizerWrapper(vocabulary), n_vocab=tok.vocab_size, eos_token=eos)


class _Vocabulary:
    """A tokenizer as llguidance's TokenizerWrapper reads it: each token's bytes, the special
    ids, and encoding (of text only: the wrapper probes with bytes and falls back to text)."""

    def __init__(self, tok: Any, tokens: list[bytes], special_token_ids: list[int]) -> None:
        self._tok = tok
        self.eos_token_id = tok.eos_token_id
        self.bos_token_id = tok.bos_token_id
        self.tokens = tokens
        self.special_token_ids = special_token_ids

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("encodes text, not bytes")
        return self._tok.encode(text)


class GrammarMatcher:
    """One request's place in its grammar: which tokens may come next, and whether it is done.

    It depends only on the output tokens consumed so far, so any worker rebuilds it from them.
    """

    __slots__ = ("_m",)

    def __init__(self, matcher: llg.LLMatcher) -> None:
        self._m = matcher

    def allowed_bitmask(self) -> bytes:
        """One bit per token id (little-endian 32-bit words), set where the token may come next."""
        return _guarded(self._m.compute_bitmask)

    def advance(self, token_id: int) -> bool:
        """Consume one sampled token; False (and `error` set) when the grammar refuses it."""
        return bool(_guarded(self._m.consume_token, token_id))

    def advance_all(self, token_ids: list[int]) -> bool:
        return not token_ids or bool(_guarded(self._m.consume_tokens, token_ids))

    @property
    def done(self) -> bool:
        """The grammar is complete (only an end of sequence could follow), or it failed."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        if not self._m.is_error():
            return None
        message = _short(self._m.get_error())
        # A bare stop reason (e.g. NoExtensionBias): the grammar admits nothing from here on.
        return f"the grammar admits no further output ({message})" if " " not in message else message


class GrammarCompiler:
    """Compiles constraints for one tokenizer, keeping the most recent ones (bounded) to copy.

    Thread-safe: the router compiles on its worker threads. The llguidance view of the vocabulary
    is built on first use (a fraction of a second for a 50k vocabulary).
    """

    def __init__(self, tokenizer: Any, cache_size: int = 64) -> None:
        self._tokenizer = tokenizer
        self._ll: llg.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], llg.LLMatcher] = OrderedDict()
        self._cache_size = cache_size

    def ll_tokenizer(self) -> llg.LLTokenizer:
        with self._lock:
            if self._ll is None:
                try:
                    self._ll = llg_tokenizer(self._tokenizer)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as exc:  # noqa: BLE001 - a tokenizer llguidance cannot read
                    raise GrammarError(f"structured outputs are not available for this model's "
                                       f"tokenizer: {_short(str(exc))}") from None
            return self._ll

    def lookup(self, spec: StructuredOutput) -> GrammarMatcher | None:
        """A fresh matcher if this exact constraint text was compiled lately, else None; a dict
        look-up, nothing parsed: what an engine loop may call."""
        with self._lock:
            pristine = self._cache.get((spec.kind, spec.spec))
            if pristine is None:
                return None
            self._cache.move_to_end((spec.kind, spec.spec))
            return GrammarMatcher(pristine.deep_copy())

    def compile(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher at the grammar's start; GrammarError when the constraint is bad.
        Compiled once per meaning: a schema differing only in its annotations is a cache hit."""
        found = self.lookup(spec)
        if found is not None:
            return found
        key, value = prepare(spec)
        with self._lock:
            pristine = self._cache.get(key)
        if pristine is None:
            grammar = _grammar_of(spec, value)
            ll = self.ll_tokenizer()
            failed, messages = _guarded(
                lambda: llg.LLMatcher.validate_grammar_with_warnings(grammar, ll, limits=parser_limits())
            )
            if failed:
                raise GrammarError(_short(messages[0] if messages else "invalid grammar"))
            matcher = _guarded(lambda: llg.LLMatcher(ll, grammar, log_level=0, limits=parser_limits()))
            if matcher.is_error():
                # Valid syntax whose language is empty (e.g. an empty character class).
                raise GrammarError("no output can satisfy it: " + _short(matcher.get_error()))
            pristine = matcher.deep_copy()
        with self._lock:
            # The text and the meaning share one pristine matcher (and one slot of the bound each).
            for k in {key, (spec.kind, spec.spec)}:
                self._cache[k] = pristine
                self._cache.move_to_end(k)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return GrammarMatcher(pristine.deep_copy())

    def check(self, spec: StructuredOutput) -> None:
        """What the router runs: compile, and compute the first mask, where lazily built lexers
        do their work and an empty language shows; GrammarError when the constraint is bad."""
        matcher = self.compile(spec)
        matcher.allowed_bitmask()
        if matcher.error is not None:
            raise GrammarError(f"no output can satisfy it: {matcher.error}")
