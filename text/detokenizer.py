"""Incremental detokenization: turn a stream of token ids into a stream of complete text.

One byte-level token can hold part of a UTF-8 character (an emoji is often 2-4 tokens), and
some decoders change a token's text depending on what precedes it (a leading space). So a new
token's text is not `decode([token])`; it is the difference between decoding a short window with
and without it. The window (vLLM's prefix/read offsets) keeps each push O(window), not O(output):

    tokens:  ... emitted long ago ... | prefix_offset ... read_offset | new tokens
                 (dropped)              (already emitted: context)     (not emitted yet)
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Detokenizes one request's output. Owned by one request; not thread-safe.

    Invariant: `text` + the decode of the held-back tokens == `tokenizer.decode(all pushed ids)`,
    and after `flush()` `text` alone equals it less any trailing U+FFFD (an incomplete final
    character). No chunk ends in a partial UTF-8 character, and no chunk ends in U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._window: list[int] = []  # tokens from prefix_offset on
        self._read_offset = 0  # index in _window of the first token not yet emitted
        self._chunks: list[str] = []
        self._text_cache: str | None = ""

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text they complete ("" while a character is still partial)."""
        if not token_ids:
            return ""
        self._window.extend(token_ids)
        prefix_text = self._decode(self._window[: self._read_offset])
        full_text = self._decode(self._window)
        # A trailing U+FFFD means the last bytes are an incomplete character: wait for more.
        # Decoding must also have grown: special tokens skipped add nothing yet.
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        return self._emit(full_text[len(prefix_text) :])

    def flush(self) -> str:
        """Emit what is held back at the end of a request, less an incomplete final character.

        Generation cut inside a multi-byte character (max_tokens) leaves bytes that decode to
        U+FFFD; they are dropped, not shown. Only the held-back tail is trimmed, so a U+FFFD
        emitted earlier stays; one the model itself wrote as its very last text is lost too.
        """
        if self._read_offset == len(self._window):
            return ""
        prefix_text = self._decode(self._window[: self._read_offset])
        full_text = self._decode(self._window)
        return self._emit(full_text[len(prefix_text) :].rstrip(_REPLACEMENT))

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
            self._chunks = [self._text_cache]
        return self._text_cache

    def _emit(self, new_text: str) -> str:
        # The tokens just emitted become the next push's context; older ones are dropped.
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        if new_text:
            self._chunks.append(new_text)
            self._text_cache = None
        return new_text

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
