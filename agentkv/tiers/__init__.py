"""Tiered KV block stores: host RAM arena, disk files (O_DIRECT, checksummed), GDS when present.

Primitives (re-exported here; each lives in its own module):
    ModelFingerprint, BlockKey, logical_key,
    rank_key, block_keys                       the one key scheme (keys.py)
    TieredStore, TransferHandle, BlockResult,
    BlockStatus, StoreStats, TierUsage,
    HostRead                                   the async tiered store (store.py)
    Tier, Locality                             the one tier model (agentkv.tier)
    RemoteConfig, RemoteBlocks, RemoteStats    the shared Valkey/Redis tier (remote.py)
    ValkeyProcess                              a private valkey-server (valkey_server.py)
    HostArena                                  preallocated fixed-slot host memory (host.py)
    BlockFiles                                 checksummed block files (disk.py)
    gds_available                              GPUDirect Storage probe (gds.py)

Nothing here imports torch, vllm, kvikio or the valkey client at import time.
"""

from __future__ import annotations

from agentkv.tier import Locality, Tier
from agentkv.tiers.disk import BlockFiles
from agentkv.tiers.gds import gds_available
from agentkv.tiers.host import HostArena
from agentkv.tiers.keys import BlockKey, ModelFingerprint, block_keys, logical_key, rank_key
from agentkv.tiers.remote import RemoteBlocks, RemoteConfig, RemoteStats
from agentkv.tiers.store import (
    BlockResult,
    BlockStatus,
    HostRead,
    StoreStats,
    TieredStore,
    TierUsage,
    TransferHandle,
)
from agentkv.tiers.valkey_server import ValkeyProcess

__all__ = [
    "BlockFiles",
    "BlockKey",
    "BlockResult",
    "BlockStatus",
    "HostArena",
    "HostRead",
    "Locality",
    "ModelFingerprint",
    "RemoteBlocks",
    "RemoteConfig",
    "RemoteStats",
    "StoreStats",
    "Tier",
    "TierUsage",
    "TieredStore",
    "TransferHandle",
    "ValkeyProcess",
    "block_keys",
    "gds_available",
    "logical_key",
    "rank_key",
]
