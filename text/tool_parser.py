r"""Model output to tool calls, incrementally: text in, content and call pieces out.

`ToolCallParser` is fed an output's text as it arrives and gives back what is safe to show:
content, and pieces of calls (a call's first piece carries its id and name, later ones more of
its arguments). Whole or in any split, the same text gives the same result, so streaming and
non-streaming answers agree. The format is text/tools.py's:

    content <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
            |-- OPEN -|  |---------- head ---------||arg|   |-- CLOSE -|

- Text that may begin OPEN is held until it does or cannot; so is trailing whitespace, because
  whitespace next to a call block is dropped.
- A block whose head is `{"name": "<name>", "arguments": {` (any JSON whitespace) is a call
  from there on: the name goes out at once, the arguments object as it comes (read as JSON, so
  a CLOSE inside one of its strings is text), and what follows it up to CLOSE is dropped. Under
  `required` or a named function the grammar makes every block so.
- Any other block is kept whole until CLOSE: a JSON object with a string `name` and `arguments`
  is a call, anything else stays content, markers and all; so does a block the model left open.
- Output cut off by max_tokens (`finish(truncated=True)`) leaves no markup in the content: an
  unfinished block and a trailing beginning of OPEN are dropped; a call cut off in its arguments
  goes out with what came (OpenAI's truncated answer: finish_reason "length").
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from pdserve.text.tools import CLOSE, OPEN

_WS = " \t\r\n"
_MAX_HEAD_CHARS = 256  # a head this long that is still undecided is not ours: keep it whole


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(slots=True)
class CallPiece:
    """Part of the `index`-th call: the first piece has `id` and `name`, every piece some
    `arguments` text (possibly empty); a call's pieces joined are its arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class Parsed:
    """What one `push` or `finish` gives out, in output order within each kind."""

    content: str = ""
    calls: list[CallPiece] = field(default_factory=list)

    def __iadd__(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.calls.extend(other.calls)
        return self


class _State(Enum):
    TEXT = "text"  # outside any block
    HEAD = "head"  # inside a block, its head not yet read
    ARGS = "args"  # inside a canonical block: streaming the arguments
    TAIL = "tail"  # after a call's arguments: skipping to CLOSE
    WHOLE = "whole"  # inside another block: kept until CLOSE


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def read_head(block: str) -> tuple[str, int] | bool:
    """Match a block's start against `{"name": "<name>", "arguments": {`: (name, where the
    arguments start) on a match, True while the text so far could still become one, False when
    it cannot."""
    i, n = 0, len(block)

    def ws(i: int) -> int:
        while i < n and block[i] in _WS:
            i += 1
        return i

    for piece in ("{", '"name"', ":", '"'):
        i = ws(i)
        if block.startswith(piece, i):
            i += len(piece)
        else:
            return piece.startswith(block[i:])  # the text ran out inside the piece, or differs
    end = i
    while end < n and block[end] not in '"\\\n':
        end += 1
    if end == n:
        return True
    if block[end] != '"':
        return False  # an escaped or multi-line name: not the canonical form
    name, i = block[i:end], end + 1
    for piece in (",", '"arguments"', ":"):
        i = ws(i)
        if block.startswith(piece, i):
            i += len(piece)
        else:
            return piece.startswith(block[i:])
    i = ws(i)
    if i == n:
        return bool(name)
    return (name, i) if name and block[i] == "{" else False


class ToolCallParser:
    """One output's parser; `push` text as it comes, `finish` once at the end."""

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._new_id = new_id
        self._state = _State.TEXT
        self._buf = ""  # text not given out yet, of the current state
        self._after_call = False  # drop the whitespace that follows a block
        self._gap = ""  # the whitespace dropped before the open block: restored if it is no call
        self.num_calls = 0
        # Where the arguments scan is: brackets open, inside a string, after a backslash.
        self._depth, self._in_string, self._escaped = 0, False, False

    def push(self, text: str) -> Parsed:
        out = Parsed()
        self._buf += text
        while self._step(out):
            pass
        return out

    def finish(self, truncated: bool = False) -> Parsed:
        """Give out everything held: the output ended. `truncated`: it was cut off (max_tokens)
        rather than ended by the model, so what it left open is markup cut short and is dropped:
        a block without its head, a block without its end, a beginning of OPEN (a call cut off in
        its arguments still goes out, with the arguments that came)."""
        out = Parsed()
        if self._state is _State.TEXT:
            rest = self._buf
            if truncated and (keep := len(rest) - partial_suffix(rest, OPEN)) < len(rest):
                rest = rest[:keep].rstrip(_WS)
            rest = rest.rstrip(_WS) if self.num_calls else rest
            out.content += rest.lstrip(_WS) if self._after_call else rest
        elif self._state is _State.ARGS:  # cut off inside the arguments: they end where it did
            if self._buf:
                out.calls.append(CallPiece(self.num_calls - 1, self._buf))
        elif self._state is not _State.TAIL and not truncated:  # a block the model left open: text
            out.content += self._gap + OPEN + self._buf
        self._state, self._buf = _State.TEXT, ""
        return out

    # --- one transition at a time; True while there may be another -------------------------

    def _step(self, out: Parsed) -> bool:
        if self._state is _State.TEXT:
            return self._text(out)
        if self._state is _State.HEAD:
            return self._head(out)
        if self._state is _State.ARGS:
            return self._args(out)
        if self._state is _State.TAIL:
            return self._tail()
        return self._whole(out)

    def _text(self, out: Parsed) -> bool:
        if self._after_call:
            self._buf = self._buf.lstrip(_WS)
            if not self._buf:
                return False
            self._after_call = False
        at = self._buf.find(OPEN)
        if at >= 0:
            before = self._buf[:at].rstrip(_WS)
            out.content += before
            self._gap = self._buf[len(before) : at]
            self._buf, self._state = self._buf[at + len(OPEN) :], _State.HEAD
            return True
        keep = partial_suffix(self._buf, OPEN)
        safe = self._buf[: len(self._buf) - keep].rstrip(_WS)
        out.content += safe
        self._buf = self._buf[len(safe) :]
        return False

    def _head(self, out: Parsed) -> bool:
        head = read_head(self._buf)
        if isinstance(head, tuple):
            name, start = head
            out.calls.append(CallPiece(self.num_calls, "", self._new_id(), name))
            self.num_calls += 1
            self._buf, self._state = self._buf[start:], _State.ARGS
            self._depth, self._in_string, self._escaped = 0, False, False
            return True
        if head and len(self._buf) <= _MAX_HEAD_CHARS and CLOSE not in self._buf:
            return False  # wait for more
        self._state = _State.WHOLE
        return True

    def _args(self, out: Parsed) -> bool:
        """Scan the arguments as JSON, giving out what is scanned, up to the object's end."""
        index, buf, i = self.num_calls - 1, self._buf, 0
        while i < len(buf):
            ch = buf[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    out.calls.append(CallPiece(index, buf[: i + 1]))
                    self._buf, self._state = buf[i + 1 :], _State.TAIL
                    return True
            elif ch == "<" and CLOSE.startswith(buf[i : i + len(CLOSE)]):
                if buf.startswith(CLOSE, i):  # the block ended inside the arguments
                    if i:
                        out.calls.append(CallPiece(index, buf[:i]))
                    self._end_block(i)
                    return True
                break  # perhaps CLOSE: wait for the rest
            i += 1
        if i:
            out.calls.append(CallPiece(index, buf[:i]))
            self._buf = buf[i:]
        return False

    def _tail(self) -> bool:
        at = self._buf.find(CLOSE)
        if at >= 0:
            self._end_block(at)
            return True
        self._buf = self._buf[len(self._buf) - partial_suffix(self._buf, CLOSE) :]
        return False

    def _whole(self, out: Parsed) -> bool:
        at = self._buf.find(CLOSE)
        if at < 0:
            return False
        block = self._buf[:at]
        call = _loose_call(block)
        if call is None:
            out.content += self._gap + OPEN + block + CLOSE
            self._buf, self._state = self._buf[at + len(CLOSE) :], _State.TEXT
            return True
        name, arguments = call
        out.calls.append(CallPiece(self.num_calls, "", self._new_id(), name))
        out.calls.append(CallPiece(self.num_calls, arguments))
        self.num_calls += 1
        self._end_block(at)
        return True

    def _end_block(self, close_at: int) -> None:
        self._buf = self._buf[close_at + len(CLOSE) :]
        self._state, self._after_call = _State.TEXT, True


def _loose_call(block: str) -> tuple[str, str] | None:
    """A non-canonical block read as JSON: (name, arguments text) or None when it is not a call."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get("arguments", {})
    if isinstance(args, str):
        return value["name"], args
    if isinstance(args, dict):
        return value["name"], json.dumps(args, ensure_ascii=False)
    return None
