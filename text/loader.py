"""A model's tokenizer, loaded without its weights (what the router uses).

The router tokenizes prompts and detokenizes outputs but never runs the model, so it reads only
the tokenizer: a GGUF file's metadata (the tensors stay unread on disk) or a Hugging Face
directory's tokenizer files. Nothing here imports torch.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from pdserve.text.detokenizer import IncrementalDetokenizer
from pdserve.text.model_files import ModelFormat, ModelLoadError, resolve_model
from pdserve.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class TokenizerSource(NamedTuple):
    name: str  # the served model name unless --served-model-name overrides it
    tokenizer: Tokenizer


def load_tokenizer(spec: str | None = "default") -> TokenizerSource:
    """Load the tokenizer that `spec` (as in `--model`) names; ModelLoadError when it cannot."""
    files = resolve_model(spec)
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
    log.info("tokenizer of %s loaded from %s (%d tokens)", files.name, files.path, tokenizer.vocab_size)
    return TokenizerSource(files.name, tokenizer)


def default_detokenizer_factory(tokenizer: Tokenizer) -> IncrementalDetokenizer:
    """One IncrementalDetokenizer per choice."""
    return IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
