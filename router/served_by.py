"""Which workers served a response: headers at its start, and a closing SSE comment.

The route is picked before the first byte, so a chat or completion response names it in headers:

    x-pdserve-mode            disaggregated | colocated
    x-pdserve-prefill-worker  the worker that computed the prompt (colocated: the only one)
    x-pdserve-decode-worker   the worker that generates after the first token (colocated: the same)

With n > 1 each header lists the choices in index order, comma-separated. A worker id is sent
percent-encoded (RFC 3986) wherever a character falls outside `SAFE`, so an id never breaks the
header block nor the list, and `decodeURIComponent` gives it back.

A choice may migrate mid-stream (its worker was lost or gave it up): a stream therefore ends, just
before `data: [DONE]`, with one SSE comment naming every choice's final route:

    : pdserve served-by {"choices":[{"index":0,"mode":"disaggregated","prefill":"prefill-0",
                                     "decode":"decode-1","migrations":1}]}

A comment is ignored by every SSE client (the `openai` package included), so the chunk schema stays
the standard one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from urllib.parse import quote

import msgspec

from pdserve.router.requests import Choice

PREFILL_HEADER = "x-pdserve-prefill-worker"
DECODE_HEADER = "x-pdserve-decode-worker"
MODE_HEADER = "x-pdserve-mode"
COMMENT_PREFIX = b": pdserve served-by "
SAFE = "-._~:@/+"  # with letters and digits: left as they are in a header value


class ServedBy(msgspec.Struct):
    """One choice's route as the closing comment states it."""

    index: int
    mode: str
    prefill: str
    decode: str
    migrations: int


class ServedByComment(msgspec.Struct):
    choices: list[ServedBy]


def served_by(choices: Sequence[Choice]) -> list[ServedBy]:
    return [
        ServedBy(c.index, c.route.mode, c.route.first, c.route.decode or c.route.first, c.migrations)
        for c in choices
    ]


def route_headers(choices: Sequence[Choice]) -> dict[str, str]:
    """The three headers for the choices' current routes."""
    routes = served_by(choices)
    return {
        MODE_HEADER: ",".join(r.mode for r in routes),
        PREFILL_HEADER: ",".join(quote(r.prefill, safe=SAFE) for r in routes),
        DECODE_HEADER: ",".join(quote(r.decode, safe=SAFE) for r in routes),
    }


def route_comment(choices: Sequence[Choice]) -> bytes:
    """The closing SSE comment, all ASCII: JSON escapes CR and LF, and `ensure_ascii` also escapes
    U+2028 and the like, which line readers such as `str.splitlines` (httpx's) would break on."""
    data = msgspec.to_builtins(ServedByComment(served_by(choices)))
    return COMMENT_PREFIX + json.dumps(data, separators=(",", ":")).encode("ascii") + b"\n\n"
