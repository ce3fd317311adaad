"""Per-block transfer outcomes shared by every tier (re-exported by store.py).

Primitives:
    TierName      'host', 'disk' or 'remote'.
    BlockStatus   ok / miss / error.
    BlockResult   the outcome for one block: status, the tier involved, the error.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

from agentkv.errors import TierError
from agentkv.tiers.keys import BlockKey

TierName = Literal["host", "disk", "remote"]


class BlockStatus(enum.Enum):
    OK = "ok"
    MISS = "miss"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class BlockResult:
    """The outcome for one block of a transfer."""

    key: BlockKey
    status: BlockStatus
    tier: TierName | None = None
    error: TierError | None = None

    @property
    def ok(self) -> bool:
        return self.status is BlockStatus.OK
