"""Which tier holds each logical KV block, which trajectories own it, how many each tier holds.

Primitives:
  BlockIndex.tier_of(key)           -> "host" | "disk" | None
  BlockIndex.put(key, tier, owner)  record a block in ``tier`` (or move it there) and add an owner
  BlockIndex.add_owner(key, owner)  one more trajectory relies on an indexed block
  BlockIndex.move(key, tier)        the block now lives in another tier (promote / demote)
  BlockIndex.forget(key)            the tiers no longer hold it (evicted, corrupt): remove it
  BlockIndex.release(owner)         the owner ended: remove it everywhere; returns the keys no
                                    one owns any more (removed from the index: the caller drops them)
  BlockIndex.count(tier)            blocks in ``tier``, O(1): read on every pause and scrape

Pure bookkeeping for the scheduler (one writer lock is the caller's). Counts are kept on every
change rather than recounted, because status, pause decisions and /metrics scrapes read them
while holding the lock the engine thread needs, and a scan over millions of blocks would stall it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class _Entry:
    tier: str
    owners: set[str] = field(default_factory=set)


class BlockIndex:
    def __init__(self) -> None:
        self._entries: dict[bytes, _Entry] = {}
        self._by_owner: dict[str, set[bytes]] = {}
        self._counts: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self._entries))

    def tier_of(self, key: bytes) -> str | None:
        entry = self._entries.get(key)
        return entry.tier if entry is not None else None

    def owners(self, key: bytes) -> frozenset[str]:
        entry = self._entries.get(key)
        return frozenset(entry.owners) if entry is not None else frozenset()

    def keys_of(self, owner: str) -> frozenset[bytes]:
        return frozenset(self._by_owner.get(owner, ()))

    def count(self, tier: str) -> int:
        return self._counts[tier]

    def put(self, key: bytes, tier: str, owner: str) -> None:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(tier)
            self._counts[tier] += 1
        elif entry.tier != tier:
            self.move(key, tier)
        self.add_owner(key, owner)

    def add_owner(self, key: bytes, owner: str) -> None:
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(key)
        entry.owners.add(owner)
        self._by_owner.setdefault(owner, set()).add(key)

    def move(self, key: bytes, tier: str) -> None:
        entry = self._entries[key]
        if entry.tier != tier:
            self._counts[entry.tier] -= 1
            self._counts[tier] += 1
            entry.tier = tier

    def forget(self, key: bytes) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._counts[entry.tier] -= 1
        for owner in entry.owners:
            keys = self._by_owner.get(owner)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_owner[owner]
        return True

    def release(self, owner: str) -> list[bytes]:
        orphans = []
        for key in self._by_owner.pop(owner, set()):
            entry = self._entries.get(key)
            if entry is None:
                continue
            entry.owners.discard(owner)
            if not entry.owners:
                del self._entries[key]
                self._counts[entry.tier] -= 1
                orphans.append(key)
        return orphans
