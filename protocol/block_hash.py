"""Chained content hashes of full KV blocks, shared by the prefix cache and prefix-aware routing.

hash(block i) = blake2b(key=KEY, parent=hash(block i-1), token ids of block i), so two blocks
match only when their whole prefix matches. A keyed cryptographic hash, never Python's `hash()`:
collisions would silently serve another prompt's KV.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_KEY = b"pdserve-prefix-v1"
ROOT = b""


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16, key=_KEY)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def hash_blocks(token_ids: Sequence[int], block_size: int, start: int = 0, parent: bytes = ROOT) -> list[bytes]:
    """Hashes of the full blocks of `token_ids`, from block `start` (whose parent hash is given)."""
    out = []
    for i in range(start, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out
