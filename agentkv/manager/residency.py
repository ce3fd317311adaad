"""The residency index: which tier holds each KV block, who owns it, what is in flight. The only one.

Primitives:
  Entry                       one key: complete copies in host / disk, the tier being written,
                              in-flight readers, owners (trajectory ids), last use, and until
                              when the shared remote tier is known to hold it
  ResidencyIndex.usable(key)  Tier.HOST | Tier.DISK | None: a complete, readable local copy
  note_external / external    the remote tier (Locality.EXTERNAL) holds the key until a time:
                              known from this replica's own uploads and fetches; other replicas
                              write it and its TTL expires it, so this is a hint (skip an upload
                              already done), never what a load trusts
  begin_write / end_write     two-phase: a store (or promote/demote) reserves its slot, then the
                              copy becomes readable only when every rank reported it written
  spoil_writes                a drop overtook writes in flight: they never become readable
  begin_read / end_read       loads and moves in flight pin the key: never evicted or dropped
                              mid-copy (a drop while pinned is deferred); a load marks the key
                              read, and ``unread_dropped`` counts complete copies that left the
                              index without any load reading them
  own / disown                ownership by reference, in flight included; disown returns the keys
                              no one owns any more (the caller drops them); own revives a doomed key
  victims(tier, n)            eviction order: idle keys only, least recently used first (on
                              request, keys disk also holds before the others)
  remove_copy                 a tier no longer holds the key (evicted, corrupt, missing)
  count(tier), reserved(tier) O(1) per-tier counts (read on every pause and scrape)
  hold_late / release_late    slots of a timed-out write stay taken until every rank reported
  record_changes / take_changes
                              opt-in log of (key, tier, present) whenever a tier gains or loses a
                              complete copy, in order (the source of the connector's KV events)

Pure bookkeeping under the manager's lock. The tier stores execute what the manager decides from
this index; they never evict on their own, so index and stores cannot drift.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from agentkv.tier import LOCAL_TIERS as TIERS
from agentkv.tier import Tier


@dataclass
class Entry:
    host: bool = False
    disk: bool = False
    writing: set[Tier] = field(default_factory=set)
    readers: int = 0
    owners: set[str] = field(default_factory=set)
    doomed: bool = False  # unowned while busy: dropped once idle
    spoiled: set[Tier] = field(default_factory=set)  # writes a drop overtook: never readable
    # monotonic time until which the remote tier holds a copy we uploaded or fetched (0: none
    # known); an external copy alone never keeps an entry in the index
    remote_until: float = 0.0
    loaded: bool = False  # a request's load read this key (a write-back that paid)

    def has(self, tier: Tier) -> bool:
        """A complete copy in ``tier`` (remote: one was known; its TTL is ``external``'s)."""
        if tier == Tier.HOST:
            return self.host
        if tier == Tier.DISK:
            return self.disk
        if tier == Tier.REMOTE:
            return self.remote_until > 0.0
        return False

    @property
    def busy(self) -> bool:
        return bool(self.writing) or self.readers > 0

    @property
    def empty(self) -> bool:
        return not (self.host or self.disk or self.writing)


class ResidencyIndex:
    def __init__(self, capacity_blocks: dict[Tier, int]) -> None:
        self.capacity = dict(capacity_blocks)
        self._entries: dict[bytes, Entry] = {}
        # per tier: keys with a complete copy, least recently used first
        self._lru: dict[Tier, OrderedDict[bytes, None]] = {t: OrderedDict() for t in TIERS}
        self._writing: dict[Tier, int] = {t: 0 for t in TIERS}
        self._late: dict[Tier, int] = {t: 0 for t in TIERS}  # slots a late rank may fill
        self._doomed_idle: list[bytes] = []
        self._changes: list[tuple[bytes, Tier, bool]] | None = None
        # Complete copies dropped, evicted or expired that no request's load ever read: a
        # write-back that did not pay (status counter ``writebacks_unread``).
        self.unread_dropped = 0

    def record_changes(self) -> None:
        """Start logging copy changes (off by default: nobody pays for a log nobody reads)."""
        if self._changes is None:
            self._changes = []

    def take_changes(self) -> list[tuple[bytes, Tier, bool]]:
        """(key, tier, present) since the last call, in the order they happened."""
        if not self._changes:
            return []
        out, self._changes = self._changes, []
        return out

    def keys_in(self, tier: Tier) -> list[bytes]:
        """Keys with a complete copy in ``tier``, least recently used first."""
        return list(self._lru[tier])

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self._entries))

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def usable(self, key: bytes) -> Tier | None:
        """The fastest tier with a complete copy, or None. Doomed keys are not usable."""
        e = self._entries.get(key)
        if e is None or e.doomed:
            return None
        if e.host:
            return Tier.HOST
        if e.disk:
            return Tier.DISK
        return None

    def count(self, tier: Tier) -> int:
        """Complete copies in ``tier``."""
        return len(self._lru[tier])

    def reserved(self, tier: Tier) -> int:
        """Slots in ``tier`` taken: complete copies, writes in flight, and writes of timed-out
        jobs a late rank may still land."""
        return len(self._lru[tier]) + self._writing[tier] + self._late[tier]

    def hold_late(self, tier: Tier, n: int) -> None:
        """Keep ``n`` slots of a timed-out write reserved until every rank reported it."""
        self._late[tier] += n

    def release_late(self, tier: Tier, n: int) -> None:
        self._late[tier] = max(0, self._late[tier] - n)

    def free(self, tier: Tier) -> int:
        return max(0, self.capacity.get(tier, 0) - self.reserved(tier))

    def note_external(self, key: bytes, until: float) -> None:
        """The remote tier holds ``key`` until ``until`` (monotonic), as far as we know."""
        e = self._entries.get(key)
        if e is not None:
            e.remote_until = max(e.remote_until, until)

    def external(self, key: bytes, now: float) -> bool:
        """Whether the remote tier is known to hold ``key`` now."""
        e = self._entries.get(key)
        return e is not None and e.remote_until > now

    def owners(self, key: bytes) -> frozenset[str]:
        e = self._entries.get(key)
        return frozenset(e.owners) if e is not None else frozenset()

    # ------------------------------------------------------------------ writes

    def begin_write(self, key: bytes, tier: Tier, owner: str | None) -> None:
        """Reserve a slot in ``tier`` for a copy of ``key`` (the caller made room)."""
        e = self._entries.setdefault(key, Entry())
        if tier in e.writing or e.has(tier):
            raise ValueError(f"{tier} already holds or is writing this key")
        e.writing.add(tier)
        self._writing[tier] += 1
        e.doomed = False
        if owner:
            e.owners.add(owner)

    def end_write(self, key: bytes, tier: Tier, ok: bool) -> bool:
        """The write finished on every rank (``ok``) or failed on one (the slot is released).
        Returns whether the copy became readable; when not, some ranks may hold a partial copy
        the caller drops from ``tier``."""
        e = self._entries.get(key)
        if e is None or tier not in e.writing:
            return False
        e.writing.discard(tier)
        self._writing[tier] -= 1
        ok = ok and tier not in e.spoiled
        e.spoiled.discard(tier)
        if ok:
            self._set_copy(key, e, tier, True)
        self._gc(key, e)
        return ok

    def spoil_writes(self, key: bytes) -> None:
        """A drop of ``key`` goes out while writes of it are in flight: ranks that already wrote
        lose their copy, so those writes must not become readable."""
        e = self._entries.get(key)
        if e is not None:
            e.spoiled |= e.writing

    def touch(self, key: bytes) -> None:
        e = self._entries.get(key)
        if e is None:
            return
        for tier in TIERS:
            if e.has(tier):
                self._lru[tier].move_to_end(key)

    # ------------------------------------------------------------------ reads

    def begin_read(self, key: bytes, *, load: bool = True) -> None:
        """Pin ``key`` for a reader; ``load``: a request's load (not a tier-to-tier move or an
        upload), so the copy paid for its write."""
        e = self._entries[key]
        e.readers += 1
        e.loaded = e.loaded or load

    def end_read(self, key: bytes) -> None:
        e = self._entries.get(key)
        if e is None:
            return
        e.readers = max(0, e.readers - 1)
        self._gc(key, e)

    # ------------------------------------------------------------------ ownership

    def own(self, key: bytes, owner: str) -> bool:
        """Add ``owner`` to an indexed key; False when the key is not indexed. A doomed key
        (unowned while busy) is revived: its copies are as good as ever."""
        e = self._entries.get(key)
        if e is None:
            return False
        e.doomed = False
        e.owners.add(owner)
        return True

    def disown(self, keys: Iterable[bytes], owner: str) -> list[bytes]:
        """Remove ``owner`` from ``keys``; returns idle keys now unowned (to drop everywhere).
        Busy unowned keys are doomed: they are returned by a later ``end_read``/``end_write``
        through ``take_doomed``."""
        out = []
        for key in keys:
            e = self._entries.get(key)
            if e is None or owner not in e.owners:
                continue
            e.owners.discard(owner)
            if e.owners:
                continue
            if e.busy:
                e.doomed = True
            else:
                self._remove(key, e)
                out.append(key)
        return out

    # ------------------------------------------------------------------ eviction and removal

    def victims(self, tier: Tier, n: int, *, on_disk_first: bool = False) -> list[bytes]:
        """Up to ``n`` idle keys with a complete copy in ``tier``, least recently used first.
        ``on_disk_first``: keys that disk also holds come before the others (dropping their
        ``tier`` copy loses no data), each group least recently used first."""
        out: list[bytes] = []
        if n <= 0:
            return out
        # Two passes over the LRU (the backed keys, then the rest) only when asked to prefer.
        passes = (True, False) if on_disk_first else (None,)
        for want_disk in passes:
            for key in self._lru[tier]:
                e = self._entries[key]
                if e.busy or (want_disk is not None and e.disk != want_disk):
                    continue
                out.append(key)
                if len(out) >= n:
                    return out
        return out

    def remove_copy(self, key: bytes, tier: Tier | None) -> None:
        """``tier`` (None: every tier) no longer holds a complete copy of ``key``."""
        e = self._entries.get(key)
        if e is None:
            return
        for t in TIERS if tier is None else (tier,):
            self._set_copy(key, e, t, False)
        self._gc(key, e)

    def has_doomed(self) -> bool:
        return bool(self._doomed_idle)

    def take_doomed(self) -> list[bytes]:
        """Doomed keys that became idle since the last call: removed from the index already,
        the caller drops them from every tier."""
        out, self._doomed_idle = self._doomed_idle, []
        return out

    # ------------------------------------------------------------------ internals

    def _set_copy(self, key: bytes, e: Entry, tier: Tier, present: bool) -> None:
        if e.has(tier) == present:
            # Only a drop can find nothing to change: a copy is set present by ``end_write``
            # alone, for a write ``begin_write`` refuses while the tier holds the key.
            return
        if not present and not e.loaded:
            self.unread_dropped += 1
        if tier == Tier.HOST:
            e.host = present
        else:
            e.disk = present
        if present:
            self._lru[tier][key] = None
        else:
            self._lru[tier].pop(key, None)
        if self._changes is not None:
            self._changes.append((key, tier, present))

    def _gc(self, key: bytes, e: Entry) -> None:
        if e.busy:
            return
        if e.doomed:
            self._remove(key, e)
            self._doomed_idle.append(key)
        elif e.empty:
            self._remove(key, e)

    def _remove(self, key: bytes, e: Entry) -> None:
        if not e.loaded:
            self.unread_dropped += sum(e.has(t) for t in TIERS)
        for tier in TIERS:
            if self._lru[tier].pop(key, "absent") is None and self._changes is not None:
                self._changes.append((key, tier, False))
        # Only idle entries are removed (``_gc``, ``disown``): no write holds a slot, and
        # ``spoiled`` is a subset of ``writing``, so there is nothing else to release.
        self._entries.pop(key, None)
