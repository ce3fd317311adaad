"""Per-block transfer outcomes shared by every tier (re-exported by store.py).

Primitives:
    Tier          the one tier enum (agentkv.tier), re-exported: HOST, DISK, REMOTE here.
    BlockStatus   ok / miss / error.
    BlockResult   the outcome for one block: status, the tier involved, the error.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from agentkv.errors import TierError
from agentkv.tier import Tier
from agentkv.tiers.keys import BlockKey


class BlockStatus(enum.Enum):
    OK = "ok"
    MISS = "miss"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class BlockResult:
    """The outcome for one block of a transfer."""

    key: BlockKey
    status: BlockStatus
    tier: Tier | None = None
    error: TierError | None = None

    @property
    def ok(self) -> bool:
        return self.status is BlockStatus.OK
