"""One rank's TieredStore as the plugin runs it (a store that never evicts), reduced to content ids.

Primitives:
  FakeTierStore       host and disk tiers of one rank, each a dict {key: content id}; the
                      operations the worker calls, with the real store's results:
    store(keys, contents, tier)   a key already in that tier keeps its existing copy and
                                  reports OK (content addressed: no overwrite); a full tier fails
                                  the block (TierFullError in the real store); nothing is evicted
    load(keys)                    host, else disk; in neither: MISS; a damaged disk copy: ERROR
                                  (corrupt) and the copy is gone (the real store deletes the file)
    promote(keys)                 disk -> host; already in host: OK; not on disk: MISS; a full
                                  host: ERROR; a damaged disk copy: ERROR (corrupt), gone
    copy_to_disk(keys)            host -> disk keeping host (the worker's 'demote'); already on
                                  disk: OK; not in host: MISS; a full disk: ERROR
    copy_to_remote(keys, remote)  host, else disk (a damaged disk copy: ERROR, gone) -> the
                                  shared remote dict; a key the server has keeps its copy; in no
                                  local tier: ERROR
    drop(keys, tier)              forget keys in one tier or both (never fails)
    damage(key)                   fault injection: the disk copy's file no longer verifies
    tier_of(key)                  host, else disk, else None
  Result              per key: status (the real BlockStatus), tier, content, corrupt, full

Both the simulated engine (sim_engine.SimWorkers, one FakeTierStore per rank) and the store
contract tests use this class; test_fake_store.py runs one sequence of operations on it and on a
real TieredStore and asserts they agree, so the sim cannot drift from the store it stands for.
Host reads pinned while a drop happens and other timing races of the real store are not
modelled: the worker only drops between a job's start and its report when the manager asked,
and the sim completes a job atomically.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from agentkv.tiers.results import BlockStatus

Tier = Literal["host", "disk"]
Content = bytes | None


@dataclass(frozen=True)
class Result:
    key: bytes
    status: BlockStatus
    tier: str | None = None
    content: Content = None  # what a load or move read (OK results only)
    corrupt: bool = False  # ERROR: the disk copy did not verify (CorruptBlockError)
    full: bool = False  # ERROR: the tier had no room (TierFullError)

    @property
    def ok(self) -> bool:
        return self.status is BlockStatus.OK


def _ok(key: bytes, tier: str, content: Content = None) -> Result:
    return Result(key, BlockStatus.OK, tier, content)


def _miss(key: bytes) -> Result:
    return Result(key, BlockStatus.MISS)


def _full(key: bytes, tier: str) -> Result:
    return Result(key, BlockStatus.ERROR, tier, full=True)


class FakeTierStore:
    def __init__(self, host_slots: int, disk_slots: int) -> None:
        self.capacity: dict[Tier, int] = {"host": host_slots, "disk": disk_slots}
        self.host: dict[bytes, Content] = {}
        self.disk: dict[bytes, Content] = {}
        self.damaged: set[bytes] = set()  # disk copies whose file no longer verifies

    def __getitem__(self, tier: Tier) -> dict[bytes, Content]:
        return self.host if tier == "host" else self.disk

    def tier_of(self, key: bytes) -> Tier | None:
        if key in self.host:
            return "host"
        return "disk" if key in self.disk else None

    def _room(self, tier: Tier) -> bool:
        return len(self[tier]) < self.capacity[tier]

    def _read_disk(self, key: bytes) -> Result:
        """A disk copy read (and verified): a damaged one is an error and is deleted."""
        if key in self.damaged:
            self.damaged.discard(key)
            del self.disk[key]
            return Result(key, BlockStatus.ERROR, "disk", corrupt=True)
        return _ok(key, "disk", self.disk[key])

    # ------------------------------------------------------------------ the worker's calls
    def store(self, keys: Sequence[bytes], contents: Sequence[Content], tier: Tier) -> list[Result]:
        out = []
        for key, content in zip(keys, contents, strict=True):
            copies = self[tier]
            if key in copies:
                out.append(_ok(key, tier))  # the existing copy stays
            elif not self._room(tier):
                out.append(_full(key, tier))
            else:
                copies[key] = content
                out.append(_ok(key, tier))
        return out

    def load(self, keys: Sequence[bytes]) -> list[Result]:
        out = []
        for key in keys:
            if key in self.host:
                out.append(_ok(key, "host", self.host[key]))
            elif key in self.disk:
                out.append(self._read_disk(key))
            else:
                out.append(_miss(key))
        return out

    def promote(self, keys: Sequence[bytes]) -> list[Result]:
        out = []
        for key in keys:
            if key in self.host:
                out.append(_ok(key, "host"))
            elif key not in self.disk:
                out.append(_miss(key))
            elif not self._room("host"):
                out.append(_full(key, "host"))
            else:
                read = self._read_disk(key)
                if read.ok:
                    self.host[key] = read.content
                    read = _ok(key, "host", read.content)
                out.append(read)
        return out

    def copy_to_disk(self, keys: Sequence[bytes]) -> list[Result]:
        out = []
        for key in keys:
            if key in self.disk:
                out.append(_ok(key, "disk"))
            elif key not in self.host:
                out.append(_miss(key))
            elif not self._room("disk"):
                out.append(_full(key, "disk"))
            else:
                self.disk[key] = self.host[key]
                out.append(_ok(key, "disk", self.host[key]))
        return out

    def copy_to_remote(self, keys: Sequence[bytes], remote: dict[bytes, Content]) -> list[Result]:
        out = []
        for key in keys:
            if key in self.host:
                read = _ok(key, "host", self.host[key])
            elif key in self.disk:
                read = self._read_disk(key)
            else:
                read = Result(key, BlockStatus.ERROR, None)  # in no local tier
            if read.ok:
                remote.setdefault(key, read.content)  # on the server already: not resent
                read = _ok(key, "remote", read.content)
            out.append(read)
        return out

    def drop(self, keys: Sequence[bytes], tier: Tier | None = None) -> int:
        """Returns how many keys were present in ``tier`` (None: host or disk)."""
        present = 0
        for key in keys:
            found = False
            for t in ("host", "disk") if tier is None else (tier,):
                if key in self[t]:
                    del self[t][key]
                    found = True
                    if t == "disk":
                        self.damaged.discard(key)
            present += found
        return present

    def damage(self, key: bytes) -> bool:
        """The disk copy of ``key`` no longer verifies (a flipped bit, a truncated file)."""
        if key not in self.disk:
            return False
        self.damaged.add(key)
        return True
