"""Chat templates of the Qwen2.5, Qwen3 and Gemma 3 families, written for pdserve's tests from the
families' published prompt formats, with the tokens each format needs.

`tokenizer_config(name)` is the tokenizer_config.json of a model directory of that family: put
it next to a tokenizer.json whose vocabulary has `added_tokens(name)` (each with its `special`
flag) and pdserve's Tokenizer.from_dir reads the template, the BOS/EOS and the stop tokens from
it. The flags matter: a special token is markup only the template may write (it is skipped when
decoding), while Qwen's `<tool_call>`, `<think>` and the like are ordinary added tokens, kept in
the decoded text where the tool-call parser reads them and the grammar of calls may write them.

    from tests.helpers.chat_templates import add_family_tokens, tokenizer_config
    add_family_tokens(backend, "qwen3")  # a tokenizers.Tokenizer
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config("qwen3", backend.token_to_id)))
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

_HERE = Path(__file__).parent


class AddedToken(NamedTuple):
    """A token a family's tokenizer adds to its vocabulary; `special`: markup, skipped when decoding."""

    content: str
    special: bool


@dataclass(frozen=True, slots=True)
class Family:
    """What a chat format needs from its tokenizer."""

    name: str
    bos_token: str | None  # None: the format has no BOS (Qwen)
    eos_token: str  # what ends an assistant turn in this format
    pad_token: str | None
    add_bos_token: bool
    end_of_turn: tuple[str, ...]  # every token that ends a generation (stop tokens)
    tokens: tuple[AddedToken, ...]


_QWEN_TOKENS = (
    AddedToken("<|endoftext|>", True),
    AddedToken("<|im_start|>", True),
    AddedToken("<|im_end|>", True),
    AddedToken("<tool_call>", False),
    AddedToken("</tool_call>", False),
)
FAMILIES = {
    "qwen2_5": Family("qwen2_5", None, "<|im_end|>", "<|endoftext|>", False, ("<|im_end|>", "<|endoftext|>"),
                      _QWEN_TOKENS),
    "qwen3": Family("qwen3", None, "<|im_end|>", "<|endoftext|>", False, ("<|im_end|>", "<|endoftext|>"),
                    (*_QWEN_TOKENS, AddedToken("<tool_response>", False), AddedToken("</tool_response>", False),
                     AddedToken("<think>", False), AddedToken("</think>", False))),
    "gemma3": Family("gemma3", "<bos>", "<eos>", "<pad>", True, ("<end_of_turn>", "<eos>"),
                     (AddedToken("<pad>", True), AddedToken("<eos>", True), AddedToken("<bos>", True),
                      AddedToken("<start_of_turn>", True), AddedToken("<end_of_turn>", True),
                      AddedToken("<start_of_image>", True))),
}


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"no chat template fixture {name!r}; one of {sorted(FAMILIES)}") from None


@functools.cache
def template(name: str) -> str:
    """The family's chat template (jinja source)."""
    family(name)
    return (_HERE / f"{name}.jinja").read_text(encoding="utf-8")


def added_tokens(name: str) -> tuple[AddedToken, ...]:
    """The tokens the family's tokenizer adds, in id order, with their `special` flags."""
    return family(name).tokens


def special_tokens(name: str) -> tuple[str, ...]:
    """Every token text the family's format writes as one token (special or not)."""
    return tuple(t.content for t in family(name).tokens)


def add_family_tokens(backend: Any, name: str) -> Any:
    """Add the family's tokens to a `tokenizers.Tokenizer` (in place; returned for chaining):
    special ones as control tokens, the others as plain added tokens matched whole."""
    from tokenizers import AddedToken as BackendAddedToken

    for t in family(name).tokens:
        token = BackendAddedToken(t.content, special=t.special, normalized=False)
        (backend.add_special_tokens if t.special else backend.add_tokens)([token])
    return backend


def end_of_turn_tokens(name: str) -> tuple[str, ...]:
    return family(name).end_of_turn


def tokenizer_config(name: str, token_to_id: Callable[[str], int | None] | None = None) -> dict[str, Any]:
    """tokenizer_config.json for a model directory of the family. With `token_to_id` (the
    tokenizer's, once the tokens are added) it also holds `added_tokens_decoder`, as
    transformers writes it."""
    f = family(name)
    config: dict[str, Any] = {
        "chat_template": template(name),
        "bos_token": f.bos_token,
        "eos_token": f.eos_token,
        "pad_token": f.pad_token,
        "add_bos_token": f.add_bos_token,
        "add_eos_token": False,
        "additional_special_tokens": [t.content for t in f.tokens if t.special],
        "model_max_length": 32768,
        "tokenizer_class": "GemmaTokenizerFast" if name == "gemma3" else "Qwen2TokenizerFast",
    }
    if token_to_id is not None:
        decoder = {}
        for t in f.tokens:
            i = token_to_id(t.content)
            if i is None:
                raise ValueError(f"the tokenizer lacks {t.content!r}; add added_tokens({name!r}) first")
            decoder[str(i)] = {"content": t.content, "lstrip": False, "normalized": False, "rstrip": False,
                               "single_word": False, "special": t.special}
        config["added_tokens_decoder"] = decoder
    return config


def generation_config(name: str, token_to_id: Callable[[str], int]) -> dict[str, Any]:
    """generation_config.json's stop tokens for the family (every end-of-turn token's id)."""
    f = family(name)
    config: dict[str, Any] = {"eos_token_id": [token_to_id(t) for t in f.end_of_turn]}
    if f.bos_token is not None:
        config["bos_token_id"] = token_to_id(f.bos_token)
    return config


def family_tokenizer(name: str) -> Any:
    """A pdserve Tokenizer speaking the family's format over SmolLM2's vocabulary (the default
    model's, no download): its tokens added, its template, BOS and EOS. For router and text tests."""
    from tokenizers import Tokenizer as BackendTokenizer

    from pdserve.text.tokenizer import Tokenizer
    from tests.helpers.tiny_llama import default_tokenizer

    backend = add_family_tokens(BackendTokenizer.from_str(default_tokenizer().backend.to_str()), name)
    f = family(name)
    return Tokenizer(backend, bos_token=f.bos_token, eos_token=f.eos_token, pad_token=f.pad_token,
                     chat_template=template(name))
