"""The router's tokenizer, loaded without the model's weights.

The router tokenizes prompts and detokenizes outputs but never runs the model, so it reads only
the tokenizer: a GGUF file's metadata (the tensors stay unread on disk) or a Hugging Face
directory's tokenizer files. `engine.tokenizer.load_tokenizer(spec)` is preferred once it exists
(engine.weights imports torch, which the router does not need).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

log = logging.getLogger(__name__)


class TokenizerSource(NamedTuple):
    name: str  # the served model name unless --served-model-name overrides it
    tokenizer: Any


def load_tokenizer(spec: str | None = "default") -> TokenizerSource:
    """Load the tokenizer that `spec` (as in `--model`) names; ModelLoadError when it cannot.

    Never imports torch nor reads tensors: the router process stays small.
    """
    from engine import tokenizer as tokenizer_module
    from engine.model_files import ModelFormat, ModelLoadError, resolve_model

    files = resolve_model(spec)
    loader = getattr(tokenizer_module, "load_tokenizer", None)
    if loader is not None:  # the engine's own torch-free loader, once it has one
        tok = loader(spec)
        return TokenizerSource(files.name, getattr(tok, "tokenizer", tok))
    Tokenizer = tokenizer_module.Tokenizer
    if files.format is ModelFormat.GGUF:
        from gguf import GGUFReader

        try:
            fields = GGUFReader(files.path).fields
            meta = {k: f.contents() for k, f in fields.items() if k.startswith("tokenizer.")}
        except Exception as exc:  # the reader raises ValueError, IndexError, struct errors...
            raise ModelLoadError(f"cannot read the tokenizer from {files.path}: {exc}") from exc
        tokenizer = Tokenizer.from_gguf_metadata(meta)
    else:
        tokenizer = Tokenizer.from_dir(files.path)
    log.info(
        "tokenizer of %s loaded from %s (%d tokens)", files.name, files.path, tokenizer.vocab_size
    )
    return TokenizerSource(files.name, tokenizer)


def default_detokenizer_factory(tokenizer: Any) -> Any:
    """One IncrementalDetokenizer per choice (engine/detokenizer.py)."""
    from engine.detokenizer import IncrementalDetokenizer

    return IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
