"""Paged KV blocks with reference counts and content-addressed prefix caching (torch-free).

A block holds the KV of `block_size` consecutive positions of one or more sequences. A FULL,
computed block is identified by a chained content hash, so a later request whose prompt
starts with the same tokens can reuse it instead of recomputing it.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from ..errors import EngramServeError
from .sequence import Sequence


class OutOfBlocks(EngramServeError, RuntimeError):
    """`allocate` was asked for more blocks than are free; nothing was changed."""


def block_hash(parent: bytes | None, token_ids: list[int], dead: list[bool] | None = None) -> bytes:
    """Chained content hash of one full block: blake2b over (parent hash, token ids, dead flags).

    Deterministic across processes and Python versions (unlike `hash`). Dead flags are part of
    the key because a dead token changes the Engram n-grams, hence the KV, of the tokens after
    it; an all-False mask hashes like no mask.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(b"\x00" if parent is None else b"\x01" + parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(b"\x01" + bytes(map(bool, dead)) if dead is not None and any(dead) else b"\x00")
    return h.digest()


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"BlockManager field {name}={value!r}: must be an int >= 1")


class BlockManager:
    """The KV block pool.

    Invariants (`check_invariants` verifies them; tests call it after every operation):
    - free and used blocks partition `range(num_blocks)`: a block is free iff its ref count is 0;
      no block is both free and referenced.
    - `ref_count[b]` == the number of live sequences whose `block_ids` contain `b`; a sequence
      holds a block at most once.
    - `_cached[h] == b` implies `block_hash[b] == h`. A block has a hash only once it is full
      and its KV computed; hashed blocks form a prefix of each sequence's `block_ids`.
    - A cached block whose ref count drops to 0 stays findable by `match_prefix` until it is
      handed out again. Free blocks are handed out from the front of `_free`: never-cached
      blocks first, then cached ones least recently freed first (LRU eviction).
    - Shared (matched) blocks are full and below every holder's `num_computed_tokens`, so they
      are never written again.

    Running out of blocks: `allocate` raises `OutOfBlocks` and changes nothing. Callers that
    prefer a bool ask `can_allocate` / `capacity` first (the scheduler does).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        _check_positive("num_blocks", num_blocks)
        _check_positive("block_size", block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # hash -> the block that answers for it
        self._holders: dict[int, Sequence] = {}  # id(seq) -> seq, for every seq holding blocks

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a live sequence (cached-but-free blocks count as free)."""
        return self.num_used / self.num_blocks

    def match_prefix(self, token_ids: list[int], dead: list[bool] | None = None) -> list[int]:
        """Cached full blocks matching the longest block-aligned prefix of `token_ids`. Takes no refs."""
        if not self.enable_prefix_caching:
            return []
        bs, out, parent = self.block_size, [], None
        for i in range(len(token_ids) // bs):
            parent = block_hash(parent, token_ids[i * bs:(i + 1) * bs],
                                None if dead is None else dead[i * bs:(i + 1) * bs])
            b = self._cached.get(parent)
            if b is None:
                break
            out.append(b)
        return out

    def capacity(self, seq: Sequence, prefix: list[int] = ()) -> int:
        """The most tokens `seq`'s blocks could cover after `allocate(seq, n, prefix)` right now."""
        held = len(prefix) if prefix else len(seq.block_ids)
        reused_free = sum(1 for b in prefix if self.ref_count[b] == 0)  # leave the free pool when taken
        return (held + self.num_free - reused_free) * self.block_size

    def can_allocate(self, seq: Sequence, num_tokens: int, prefix: list[int] = ()) -> bool:
        return num_tokens <= self.capacity(seq, prefix)

    # ---- mutations -----------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int, prefix: list[int] = ()) -> None:
        """Make `seq.block_ids` cover `num_tokens` positions.

        `prefix` (only for a sequence holding no blocks yet) is a `match_prefix` result: those
        blocks are shared by taking a reference, then fresh blocks are appended. Raises
        `OutOfBlocks` without changing anything if the free pool is too small.
        """
        if prefix:
            if seq.block_ids:
                raise ValueError(f"allocate({seq.request_id!r}): prefix given but the sequence "
                                 f"already holds blocks {seq.block_ids}")
            stale = [b for b in prefix if self.block_hash[b] is None or self._cached.get(self.block_hash[b]) != b]
            if stale:
                raise ValueError(f"allocate({seq.request_id!r}): prefix blocks {stale} are no longer cached")
        cap = self.capacity(seq, prefix)
        if num_tokens > cap:
            raise OutOfBlocks(f"allocate({seq.request_id!r}): num_tokens={num_tokens} needs "
                              f"{-(-num_tokens // self.block_size)} blocks, only room for {cap // self.block_size} "
                              f"(num_free={self.num_free})")
        for b in prefix:  # take refs first, so fresh allocation cannot evict them
            if self.ref_count[b] == 0:
                del self._free[b]
            self.ref_count[b] += 1
            seq.block_ids.append(b)
        while len(seq.block_ids) * self.block_size < num_tokens:
            b, _ = self._free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:  # evict: the block is about to hold other content
                if self._cached.get(h) == b:
                    del self._cached[h]
                self.block_hash[b] = None
            self.ref_count[b] = 1
            seq.block_ids.append(b)
        if seq.block_ids:
            self._holders[id(seq)] = seq

    def register_full_blocks(self, seq: Sequence) -> int:
        """Hash the blocks that became full and computed since the last call; returns how many.

        If an identical block is already cached, the earlier one keeps answering for the hash;
        this one still records its hash so that the chain of later blocks stays correct.
        """
        if not self.enable_prefix_caching:
            return 0
        bs, ids = self.block_size, seq.block_ids
        full = min(seq.num_computed_tokens, seq.num_tokens, len(ids) * bs) // bs
        first = full
        while first > 0 and self.block_hash[ids[first - 1]] is None:  # hashed blocks are a prefix
            first -= 1
        parent = self.block_hash[ids[first - 1]] if first else None
        for i in range(first, full):
            parent = block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs],
                                None if seq.dead is None else seq.dead[i * bs:(i + 1) * bs])
            self.block_hash[ids[i]] = parent
            self._cached.setdefault(parent, ids[i])
        return full - first

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references (tail first, so a tail is evicted before its prefix); block_ids = []."""
        for b in reversed(seq.block_ids):
            if self.ref_count[b] <= 0:
                raise RuntimeError(f"free({seq.request_id!r}): block {b} has ref count {self.ref_count[b]}")
            self.ref_count[b] -= 1
            if self.ref_count[b]:
                continue
            h = self.block_hash[b]
            self._free[b] = None
            if h is None or self._cached.get(h) != b:  # not findable: worthless, hand it out first
                self.block_hash[b] = None
                self._free.move_to_end(b, last=False)
        seq.block_ids = []
        self._holders.pop(id(seq), None)

    # ---- checking ------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError (explicitly, survives `python -O`) naming the first broken invariant."""
        expected = [0] * self.num_blocks
        for seq in self._holders.values():
            if not seq.block_ids:
                raise AssertionError(f"{seq.request_id!r} is registered as a holder but holds no blocks")
            if len(set(seq.block_ids)) != len(seq.block_ids):
                raise AssertionError(f"{seq.request_id!r} holds a block twice: {seq.block_ids}")
            for b in seq.block_ids:
                expected[b] += 1
        for b in range(self.num_blocks):
            free = b in self._free
            if free and self.ref_count[b]:
                raise AssertionError(f"block {b} is free but has ref count {self.ref_count[b]}")
            if not free and not self.ref_count[b]:
                raise AssertionError(f"block {b} is neither free nor referenced: free/used do not partition the pool")
            if self.ref_count[b] != expected[b]:
                raise AssertionError(f"block {b}: ref count {self.ref_count[b]} != {expected[b]} live holders")
        for h, b in self._cached.items():
            if self.block_hash[b] != h:
                raise AssertionError(f"cache maps a hash to block {b}, whose hash differs")
        if self.num_free + self.num_used != self.num_blocks:
            raise AssertionError("num_free + num_used != num_blocks")
