"""Text <-> token ids and the chat template, for a tokenizer.json directory or a GGUF file.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust library: fast, no transformers at run time)
plus what the model's files say about it: special tokens, stop tokens, chat template.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from pdserve.text.chat_template import render_chat_template
from pdserve.text.model_files import ModelLoadError

logger = logging.getLogger(__name__)

# Tokens that end a turn in common chat formats; each one the vocabulary has is a stop token.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
)

# llama.cpp's token types (gguf.TokenType).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool) -> pre_tokenizers.ByteLevel:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), _byte_level(use_regex=False)]
    )


def byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The split a byte-level BPE vocabulary was trained with, from GGUF `tokenizer.ggml.pre`."""
    if pre == "smollm":
        # llama.cpp's smollm split: every digit alone, then GPT-2's regex (as SmolLM2's tokenizer.json).
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), _byte_level(use_regex=True)]
        )
    if pre in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"):
        return _split_then_bytes(_LLAMA3_SPLIT)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return _split_then_bytes(_QWEN2_SPLIT)
    if pre not in (None, "default", "gpt2", "gpt-2"):
        logger.warning(
            "GGUF pre-tokenizer %r is not known here; using GPT-2's byte-level split. "
            "Token ids may differ from llama.cpp's for some texts.",
            pre,
        )
    return _byte_level(use_regex=True)


def _build_byte_to_char() -> dict[int, str]:
    # GPT-2's printable stand-ins for the 256 byte values (the byte-level BPE alphabet).
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
    printable += list(range(0xAE, 0xFF + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_TO_CHAR = _build_byte_to_char()
_BYTE_ALPHABET = frozenset(_BYTE_TO_CHAR.values())


def _special_token(token: Any) -> str | None:
    # tokenizer_config.json writes a special token either as a string or as an AddedToken dict.
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


class Tokenizer:
    """A model's tokenizer: encode/decode, special and stop tokens, and its chat template.

    Immutable after construction and safe to share between threads (the Rust tokenizer is).
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        extra_stop_token_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.chat_template = chat_template
        self.bos_token_id = self._id_or_none(bos_token)
        self.eos_token_id = self._id_or_none(eos_token)
        stops = [self.eos_token_id] + [self._id_or_none(t) for t in END_OF_TURN_TOKENS]
        stops += list(extra_stop_token_ids)
        self.stop_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(i for i in stops if i is not None and 0 <= i < self.vocab_size)
        )
        # Special (control) tokens by text, and a pattern finding any of them, longest first.
        self._specials = {
            t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special and t.content
        }
        self._special_re = (
            re.compile("|".join(re.escape(t) for t in sorted(self._specials, key=len, reverse=True)))
            if self._specials else None
        )
        self._text_backend: BackendTokenizer | None = None  # the backend that never matches them
        self._text_lock = threading.Lock()

    # ----- construction -------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """From a Hugging Face directory: tokenizer.json, tokenizer_config.json, chat_template.jinja,
        generation_config.json (its eos_token_id list adds stop tokens)."""
        path = Path(path)
        try:
            backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as err:
            raise ModelLoadError(f"cannot read {path / 'tokenizer.json'}: {err}") from err
        config = _read_json(path / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        eos = _read_json(path / "generation_config.json").get("eos_token_id")
        extra_stops = (
            [eos] if isinstance(eos, int) else [i for i in eos or () if isinstance(i, int)]
        )
        bos_token = _special_token(config.get("bos_token"))
        if config.get("add_bos_token") and bos_token is not None:
            _ensure_bos(backend, bos_token)
        return cls(
            backend,
            bos_token=bos_token,
            eos_token=_special_token(config.get("eos_token")),
            unk_token=_special_token(config.get("unk_token")),
            pad_token=_special_token(config.get("pad_token")),
            chat_template=template if isinstance(template, str) else None,
            extra_stop_token_ids=extra_stops,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """From GGUF `tokenizer.ggml.*` metadata; only byte-level BPE ("gpt2") vocabularies."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(
                f"GGUF tokenizer type {kind!r} is not supported (only byte-level BPE, 'gpt2'). "
                "Use the model's Hugging Face directory with its tokenizer.json instead."
            )
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [])
        alphabet = _BYTE_ALPHABET
        vocab: dict[str, int] = {}
        for index, token in enumerate(tokens):
            if not set(token) <= alphabet:  # a token stored as raw text: respell it byte-wise
                token = "".join(_BYTE_TO_CHAR[b] for b in token.encode("utf-8"))
            vocab.setdefault(token, index)
        merges = []
        for merge in meta.get("tokenizer.ggml.merges") or []:
            left, sep, right = merge.partition(" ")
            if not sep:
                raise ModelLoadError(f"GGUF tokenizer merge {merge!r} is malformed")
            merges.append((left, right))
        backend = BackendTokenizer(
            models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
        )
        backend.pre_tokenizer = byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
        backend.decoder = decoders.ByteLevel()
        # Control tokens are matched whole and skipped when decoding; user-defined ones are
        # matched whole but kept. A "control" token outside the byte alphabet is a llama.cpp
        # mislabel (transformers skips it too).
        backend.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, kind_ in zip(tokens, types, strict=False)
                if kind_ == _TOKEN_CONTROL and set(t) <= alphabet
            ]
        )
        backend.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, kind_ in zip(tokens, types, strict=False)
                if kind_ == _TOKEN_USER_DEFINED and t in vocab
            ]
        )

        def named(key: str) -> str | None:
            index = meta.get(f"tokenizer.ggml.{key}")
            return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

        bos, eos = named("bos_token_id"), named("eos_token_id")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
        if add_bos or add_eos:
            backend.post_processor = _template_processing(
                backend, bos if add_bos else None, eos if add_eos else None
            )
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            unk_token=named("unknown_token_id"),
            pad_token=named("padding_token_id"),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    # ----- encode / decode ----------------------------------------------------------------

    @property
    def backend(self) -> BackendTokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token text such as "<|im_start|>" becomes its one id."""
        # The batch entry point releases the GIL while it works (plain `encode` holds it for
        # the whole call: seconds on a 400k-token prompt, freezing every other thread).
        return self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that do not form UTF-8 come out as U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """The vocabulary's spelling of each id (byte-level alphabet, e.g. "Ġthe")."""
        return [self._backend.id_to_token(i) for i in ids]

    def token_to_piece(self, token_id: int) -> str:
        """The text one token stands for, special tokens included (may be a partial character)."""
        return self._backend.decode([token_id], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def save(self, path: str | Path) -> None:
        """Write the backend tokenizer as a tokenizer.json file."""
        self._backend.save(str(path))

    # ----- chat -------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's chat template (sandboxed jinja2, as transformers).

        Raises ValueError when the model has no template or the template fails or runs away.
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use a completion request instead")
        special = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "unk_token": self.unk_token or "",
            "pad_token": self.pad_token or "",
        }
        return render_chat_template(
            self.chat_template,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **{**special, **kwargs},
        )

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of a conversation rendered by the chat template, where only the template's
        own markup may become special tokens: special-token text inside the messages or the
        kwargs (`<|im_start|>system` in a user message) is tokenized as the text it is.

        The text is the same as `apply_chat_template`'s; ValueError as there."""
        if self._special_re is None:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs))
        # Every special-token text in the caller's values becomes a stand-in the template cannot
        # know (a fresh nonce per render), so each special token left in the output is markup.
        nonce = f"{secrets.randbelow(10**16):016d}"  # digits: unchanged by `upper`/`lower` filters
        stand_in = {t: f"\ue000{nonce}{i}\ue001" for t, i in self._specials.items()}
        found = re.compile(f"\ue000{nonce}(\\d+)\ue001")
        by_id = {i: t for t, i in self._specials.items()}
        special_re = self._special_re

        def defuse(value: Any) -> Any:
            if isinstance(value, str):
                return special_re.sub(lambda m: stand_in[m.group()], value)
            if isinstance(value, dict):
                return {defuse(k): defuse(v) for k, v in value.items()}
            if isinstance(value, list | tuple):
                return [defuse(v) for v in value]
            return value

        text = self.apply_chat_template(defuse(messages), add_generation_prompt, **defuse(kwargs))
        pieces: list[str] = []  # text, markup, text, markup, ..., text
        markup: list[int] = []
        last = 0
        for m in special_re.finditer(text):
            pieces.append(text[last : m.start()])
            markup.append(self._specials[m.group()])
            last = m.end()
        pieces.append(text[last:])
        pieces = [found.sub(lambda m: by_id[int(m.group(1))], p) for p in pieces]
        # A special token that strips the whitespace beside it does so here too.
        flags = {i: t for i, t in self._backend.get_added_tokens_decoder().items() if i in markup}
        for k, special in enumerate(markup):
            if flags[special].lstrip:
                pieces[k] = pieces[k].rstrip()
            if flags[special].rstrip:
                pieces[k + 1] = pieces[k + 1].lstrip()
        encoded = self._text_encoder().encode_batch_fast(pieces, add_special_tokens=False)
        ids = list(encoded[0].ids)
        for special, piece in zip(markup, encoded[1:], strict=True):
            ids.append(special)
            ids.extend(piece.ids)
        return ids

    def _text_encoder(self) -> BackendTokenizer:
        """A copy of the backend that tokenizes special-token text as text (built on first use)."""
        with self._text_lock:
            if self._text_backend is None:
                backend = BackendTokenizer.from_str(self._backend.to_str())
                backend.encode_special_tokens = True
                self._text_backend = backend
            return self._text_backend

    def _id_or_none(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)


def _template_processing(
    backend: BackendTokenizer, bos: str | None, eos: str | None
) -> processors.TemplateProcessing:
    pre = [f"{bos}:0"] if bos else []
    post = [f"{eos}:0"] if eos else []
    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    return processors.TemplateProcessing(
        single=" ".join(pre + ["$A:0"] + post),
        pair=" ".join(
            pre
            + ["$A:0"]
            + post
            + [p.replace(":0", ":1") for p in pre]
            + ["$B:1"]
            + [p.replace(":0", ":1") for p in post]
        ),
        special_tokens=specials,
    )


def _ensure_bos(backend: BackendTokenizer, bos: str) -> None:
    # tokenizer_config.json may ask for a BOS that tokenizer.json's post-processor does not add.
    bos_id = backend.token_to_id(bos)
    if bos_id is None or backend.encode("a", add_special_tokens=True).ids[:1] == [bos_id]:
        return
    backend.post_processor = _template_processing(backend, bos, None)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read {path}: {err}") from err
    return data if isinstance(data, dict) else {}
