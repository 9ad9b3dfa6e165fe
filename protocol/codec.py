"""The codec: one msgpack frame per message, decoded strictly against this protocol version.

Nothing here unpickles or evaluates: a frame is either a valid message of `PROTOCOL_VERSION` or a
`ProtocolError`. Tensors never pass through the codec; they travel as raw frames described by a
`TensorHeader` (kvtransfer/tensors.py).
"""

from __future__ import annotations

import msgspec

from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import PROTOCOL_VERSION, Message

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes | memoryview) -> Message:
    """Decode one message strictly; raise ProtocolError for anything else (never unpickles)."""
    try:
        msg = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(str(exc)) from None
    if msg.version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {msg.version} is not supported (this is {PROTOCOL_VERSION})")
    return msg


def open_message(auth: FrameAuth, label: bytes, frames) -> Message:
    """The one message of a received `[auth frame, message frame]` on channel `label`.
    AuthError when it does not authenticate; ProtocolError when it is not one valid message."""
    body = auth.open(label, frames)
    if len(body) != 1:
        raise ProtocolError(f"expected 1 message frame, got {len(body)}")
    return decode(body[0])
