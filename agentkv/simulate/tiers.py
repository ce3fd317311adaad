"""KV tiers below the device: host RAM and disk per replica, a remote store shared by the fleet.

Primitives:
  TierStore               one simulated tier (named by agentkv.tier.Tier): capacity in bytes
                          (None: unbounded), read and write rates, an LRU of trajectory copies
                          (blocks each), one transfer queue
  TierStore.store(tid, blocks, now)  write-back copy of a trajectory's first ``blocks`` blocks; only the
                          blocks not already there move (keys are content addresses); evicts
                          least recently stored copies for room; returns when the copy is done
  TierStore.load(tid, blocks, now)   when ``blocks`` blocks of the copy are back on the device
  TierStore.blocks(tid)   blocks of the trajectory this tier holds
  TierStore.remove(tid)   drop a copy (deleted trajectory, or moved elsewhere)

Transfers of one tier are serialized on its link (a FIFO: one copy at a time at the link's
rate), which is what makes demotion storms and reload bursts visible as queueing.
"""

from __future__ import annotations

from collections import OrderedDict

from agentkv.tier import Tier


class TierStore:
    """One tier of one replica (or of the fleet, for the remote tier)."""

    def __init__(
        self,
        name: Tier,
        capacity_bytes: float | None,
        block_bytes: float,
        read_bytes_per_s: float,
        write_bytes_per_s: float,
    ) -> None:
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.read_bps = read_bytes_per_s
        self.write_bps = write_bytes_per_s
        self.copies: OrderedDict[str, int] = OrderedDict()
        self.ready_at: dict[str, float] = {}
        self.used_blocks = 0
        self.link_free_at = 0.0
        self.bytes_written = 0.0
        self.bytes_read = 0.0
        self.evicted_copies = 0

    @property
    def used_bytes(self) -> float:
        return self.used_blocks * self.block_bytes

    def free_bytes(self) -> float | None:
        if self.capacity_bytes is None:
            return None
        return max(0.0, self.capacity_bytes - self.used_bytes)

    def blocks(self, tid: str) -> int:
        return self.copies.get(tid, 0)

    def _transfer(self, nbytes: float, rate: float, now: float) -> float:
        start = max(now, self.link_free_at)
        done = start + nbytes / rate
        self.link_free_at = done
        return done

    def store(self, tid: str, blocks: int, now: float) -> float | None:
        """Copy the trajectory's first ``blocks`` blocks here; returns when the copy is complete,
        None when it cannot fit even in an empty tier (nothing changes then)."""
        have = self.copies.get(tid, 0)
        if blocks <= have:
            self.copies.move_to_end(tid)
            return self.ready_at.get(tid, now)
        if self.capacity_bytes is not None:
            cap_blocks = int(self.capacity_bytes // self.block_bytes)
            if blocks > cap_blocks:
                return None
            while self.used_blocks - have + blocks > cap_blocks and self.copies:
                old, n = next(iter(self.copies.items()))
                if old == tid:
                    self.copies.move_to_end(tid)
                    if len(self.copies) == 1:
                        break
                    continue
                del self.copies[old]
                self.ready_at.pop(old, None)
                self.used_blocks -= n
                self.evicted_copies += 1
        nbytes = (blocks - have) * self.block_bytes
        done = self._transfer(nbytes, self.write_bps, now)
        self.bytes_written += nbytes
        self.used_blocks += blocks - have
        self.copies[tid] = blocks
        self.copies.move_to_end(tid)
        self.ready_at[tid] = done
        return done

    def load(self, tid: str, blocks: int, now: float) -> float:
        """When ``blocks`` blocks of the copy are back (after the copy itself was complete)."""
        ready = max(now, self.ready_at.get(tid, now))
        nbytes = blocks * self.block_bytes
        self.bytes_read += nbytes
        return self._transfer(nbytes, self.read_bps, ready)

    def remove(self, tid: str) -> None:
        n = self.copies.pop(tid, 0)
        self.used_blocks -= n
        self.ready_at.pop(tid, None)
