"""The simulated device of sim_engine.py: block hashes as content ids, a clock, the paged pool.

Primitives:
  chain_hashes(tokens, bs)   vLLM-style block hashes: chained content ids, so identical prefixes
                             give identical hashes (the hash *is* the content id of a full block)
  salt_root(salt)            the chain's root for a cache_salt (vLLM hashes it into block 0)
  key_of(hash)               the tier key of a block hash (blake2b of b"fp" + hash)
  SimPool                    the device block pool (ports.BlockPinner): reference counts, a prefix
                             cache by hash, a free queue (least recently freed first), the KV
                             content each TP rank holds in each block (a content id, or garbage)
  FakeClock                  ports.Clock the test advances
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

GARBAGE = b"garbage"
TierName = Literal["host", "disk"]


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    data = parent + b"".join(int(t).to_bytes(4, "little") for t in tokens)
    return hashlib.blake2b(data, digest_size=16).digest()


def chain_hashes(tokens: Sequence[int], bs: int, parent: bytes = b"root") -> list[bytes]:
    out: list[bytes] = []
    h = parent
    for i in range(len(tokens) // bs):
        h = block_hash(h, tokens[i * bs : (i + 1) * bs])
        out.append(h)
    return out


def salt_root(salt: str | None) -> bytes:
    """The parent of a request's first block hash: vLLM hashes cache_salt into the first
    block's extra keys, so the chain of every later block carries it too."""
    return b"root" if salt is None else b"root|salt=" + salt.encode()


def key_of(h: bytes) -> bytes:
    return hashlib.blake2b(b"fp" + h, digest_size=16).digest()


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


# ====================================================================== device pool


class SimPool:
    """vLLM's BlockPool, reduced: ref counts, hash metadata, a free queue, per-rank content."""

    def __init__(self, num_blocks: int, tp_size: int = 1) -> None:
        self.n = num_blocks
        self.tp = tp_size
        self.ref = [0] * num_blocks
        self.pins = [0] * num_blocks  # references taken through the BlockPinner port
        self.hash: list[bytes | None] = [None] * num_blocks  # vLLM metadata (prefix cache)
        self.content: list[list[bytes | None]] = [[None] * num_blocks for _ in range(tp_size)]
        self.cached: dict[bytes, dict[int, None]] = {}
        self.free_q: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.grow_events = 0  # blocks that went from unreferenced to referenced
        self.allocated = 0  # new blocks requests took (the adapter's filled_blocks)
        self.hit = 0  # cached blocks requests took (the adapter's hit_blocks)
        self.usage_error: Exception | None = None  # raise once from usage() (fault injection)

    # ---------------------------------------------------------------- BlockPinner port
    def pin(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            self._ref(b)
            self.pins[b] += 1

    def unpin(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            assert self.pins[b] > 0, f"unpin of block {b} below zero"
            self.pins[b] -= 1
            self._unref(b)

    def holds(self, block_id: int, block_hash: bytes) -> bool:
        return self.hash[block_id] == block_hash

    def usage(self) -> float:
        if self.usage_error is not None:
            err, self.usage_error = self.usage_error, None
            raise err
        return (self.n - len(self.free_q)) / self.n

    def total_blocks(self) -> int:
        return self.n

    # ---------------------------------------------------------------- vLLM side
    def _ref(self, b: int) -> None:
        if self.ref[b] == 0:
            self.free_q.pop(b, None)
            self.grow_events += 1
        self.ref[b] += 1

    def _unref(self, b: int) -> None:
        assert self.ref[b] > 0, f"free of block {b} below zero"
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free_q[b] = None

    def free(self, blocks: Sequence[int]) -> None:
        """A request releases its blocks (tail first, as vLLM does)."""
        for b in reversed(blocks):
            self._unref(b)

    def computed_prefix(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        out: list[int] = []
        for h in hashes[:max_blocks]:
            blocks = self.cached.get(h)
            if not blocks:
                break
            out.append(next(iter(blocks)))
        return out

    def num_free(self) -> int:
        return len(self.free_q)

    def allocate(self, hit: Sequence[int], n_new: int) -> list[int] | None:
        """Touch the hit blocks, then take ``n_new`` blocks from the free queue's head (evicting
        their cached hash). None (and nothing changed) when the pool is short."""
        free_hit = sum(1 for b in hit if self.ref[b] == 0)
        if self.num_free() - free_hit < n_new:
            return None
        for b in hit:
            self._ref(b)
        new: list[int] = []
        # As the adapter reports them (scheduler_side._sample_step): new KV, and the hit blocks
        # a request takes off the free queue.
        self.allocated += n_new
        self.hit += len(hit)
        for _ in range(n_new):
            b = next(iter(self.free_q))
            self._evict(b)
            self._ref(b)
            new.append(b)
        return new

    def _evict(self, b: int) -> None:
        h = self.hash[b]
        if h is not None:
            blocks = self.cached.get(h)
            if blocks is not None:
                blocks.pop(b, None)
                if not blocks:
                    del self.cached[h]
            self.hash[b] = None

    def cache(self, b: int, h: bytes) -> None:
        if self.hash[b] == h:
            return
        self._evict(b)
        self.hash[b] = h
        self.cached.setdefault(h, {})[b] = None

    def reset_prefix_cache(self) -> bool:
        """vLLM's plain reset (``BlockPool.reset_prefix_cache``): refused while any block is
        referenced; else every hash goes (no block hits again) and the KV stays in the blocks."""
        if any(self.ref):
            return False
        self.hash = [None] * self.n
        self.cached.clear()
        return True

    def write(self, b: int, content: bytes | None, rank: int | None = None) -> None:
        for r in range(self.tp) if rank is None else (rank,):
            self.content[r][b] = content
