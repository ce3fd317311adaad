"""Which resident block a tier gives up first: least recently used, live leases last, pins never.

Primitives:
    EvictionOrder           one per tier; not thread-safe (the store calls it under its lock).
    add / touch / remove    residency and recency.
    pin / unpin             a block in flight (being copied in or out) is never a victim.
    victim(now)             the block to evict next, or None when every block is pinned.

Order: among unpinned blocks, those without a live lease (``lease_until`` is None or already
past ``now``) go first, least recently used first; only then leased blocks, again LRU.
``victim`` scans from the LRU end and stops at the first eligible block, so its cost grows only
with the number of pinned or leased blocks it has to skip.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(slots=True)
class _Residency:
    pins: int = 0


class EvictionOrder(Generic[K]):
    """LRU with pins, honouring leases that the caller keeps (one lease table for every tier)."""

    def __init__(self, lease_of: Callable[[K], float | None]) -> None:
        """``lease_of(key)`` returns the monotonic time the key's lease ends, or None (no lease)."""
        self._lru: OrderedDict[K, _Residency] = OrderedDict()
        self._lease_of = lease_of

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    def add(self, key: K) -> None:
        """Make ``key`` resident as the most recently used block (idempotent; keeps pins)."""
        if key in self._lru:
            self._lru.move_to_end(key)
        else:
            self._lru[key] = _Residency()

    def touch(self, key: K) -> None:
        """Mark ``key`` most recently used; no-op when not resident."""
        if key in self._lru:
            self._lru.move_to_end(key)

    def remove(self, key: K) -> None:
        """Forget ``key`` (pinned or not); no-op when not resident."""
        self._lru.pop(key, None)

    def pin(self, key: K) -> None:
        """Protect ``key`` from eviction until a matching unpin. Raises KeyError when not resident."""
        self._lru[key].pins += 1

    def unpin(self, key: K) -> None:
        """Release one pin; no-op when the key was removed meanwhile."""
        residency = self._lru.get(key)
        if residency is not None and residency.pins > 0:
            residency.pins -= 1

    def pinned(self, key: K) -> bool:
        residency = self._lru.get(key)
        return residency is not None and residency.pins > 0

    def victim(self, now: float) -> K | None:
        """Return the next block to evict (see module docstring), or None when all are pinned."""
        first_leased: K | None = None
        for key, residency in self._lru.items():
            if residency.pins:
                continue
            lease_until = self._lease_of(key)
            if lease_until is None or lease_until <= now:
                return key
            if first_leased is None:
                first_leased = key
        return first_leased
