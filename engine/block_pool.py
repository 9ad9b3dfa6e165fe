"""The pool of fixed-size KV blocks: ref counts, a free list and the prefix cache.

Every block is in exactly one state:
    free    ref 0, no hash          -- handed out first
    cached  ref 0, hash known       -- holds a finished prefix; evicted LRU when space is needed
    used    ref > 0                 -- owned by one or more live requests (shared prefixes)
so `num_free + num_cached + num_used == num_blocks` always (`check_integrity`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable


class PoolCorrupted(RuntimeError):
    """A block pool invariant broke: a bug, never a client's doing."""


class BlockPool:
    """Blocks returned by `allocate`/`touch` belong to the caller until it passes them to `free`."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self._by_hash: dict[bytes, int] = {}
        self.cache_hits = 0  # blocks reused from the prefix cache, ever
        self.evictions = 0

    # --- accounting ------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached)

    @property
    def num_available(self) -> int:
        """Blocks `allocate` can hand out now (free plus evictable)."""
        return len(self._free) + len(self._cached)

    def check_integrity(self) -> None:
        """Raise PoolCorrupted unless free + cached + used == total and every list is consistent
        (a real check, not an `assert`: it must hold under `python -O` too)."""
        used = sum(1 for r in self.ref_count if r > 0)
        checks = (
            (used == self.num_used, f"{used} blocks referenced but {self.num_used} counted used"),
            (all(self.ref_count[b] == 0 and self.block_hash[b] is None for b in self._free),
             "a free block is referenced or hashed"),
            (all(self.ref_count[b] == 0 and self.block_hash[b] is not None for b in self._cached),
             "a cached block is referenced or unhashed"),
            (all(self.block_hash[b] == h for h, b in self._by_hash.items()), "the hash index is stale"),
            (self.num_free + self.num_cached + self.num_used == self.num_blocks, "blocks were lost"),
        )
        for ok, why in checks:
            if not ok:
                raise PoolCorrupted(why)

    # --- allocation ------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n blocks with ref 1, free ones first, then the least recently used cached ones."""
        if n > self.num_available:
            raise MemoryError(f"asked for {n} KV blocks, {self.num_available} available")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._cached.popitem(last=False)
                del self._by_hash[self.block_hash[block]]  # type: ignore[arg-type]
                self.block_hash[block] = None
                self.evictions += 1
            self.ref_count[block] = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; unreferenced hashed blocks stay cached (newest last).

        Pass a request's blocks in order: a prefix's tail is then evicted before its head.
        """
        for block in reversed(list(blocks)):
            ref = self.ref_count[block] - 1
            if ref < 0:
                raise PoolCorrupted(f"block {block} freed more often than allocated")
            self.ref_count[block] = ref
            if ref == 0:
                if self.block_hash[block] is not None:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    # --- prefix cache ----------------------------------------------------------------------
    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """The longest run of cached blocks matching `hashes` from the start (not yet referenced)."""
        if not self.enable_caching:
            return []
        out = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference to blocks found by `lookup`."""
        for block in blocks:
            if self.ref_count[block] == 0:
                del self._cached[block]
            self.ref_count[block] += 1
            self.cache_hits += 1

    def commit(self, block: int, block_hash: bytes) -> None:
        """Record that a used block now holds the full, computed block named by `block_hash`."""
        if not self.enable_caching or self.block_hash[block] is not None or block_hash in self._by_hash:
            return  # an identical block is already cached; this one stays private
        self.block_hash[block] = block_hash
        self._by_hash[block_hash] = block
