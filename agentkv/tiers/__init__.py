"""Tiered KV block stores: host RAM arena, disk files (O_DIRECT, checksummed), GDS when present.

Primitives (re-exported here; each lives in its own module):
    ModelFingerprint, BlockKey, chain_keys     content addresses (keys.py)
    TieredStore, TransferHandle, BlockResult,
    BlockStatus, StoreStats, TierUsage,
    HostRead                                   the async tiered store (store.py)
    TierName                                   'host' | 'disk' | 'remote' (results.py)
    RemoteConfig, RemoteBlocks, RemoteStats    the shared Valkey/Redis tier (remote.py)
    ValkeyProcess                              a private valkey-server (valkey_server.py)
    HostArena                                  preallocated fixed-slot host memory (host.py)
    BlockFiles                                 checksummed block files (disk.py)
    EvictionOrder                              LRU with pins and leases (eviction.py)
    gds_available                              GPUDirect Storage probe (gds.py)

Nothing here imports torch, vllm, kvikio or the valkey client at import time.
"""

from __future__ import annotations

from agentkv.tiers.disk import BlockFiles
from agentkv.tiers.eviction import EvictionOrder
from agentkv.tiers.gds import gds_available
from agentkv.tiers.host import HostArena
from agentkv.tiers.keys import BlockKey, ModelFingerprint, chain_keys
from agentkv.tiers.remote import RemoteBlocks, RemoteConfig, RemoteStats
from agentkv.tiers.results import TierName
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
    "EvictionOrder",
    "HostArena",
    "HostRead",
    "ModelFingerprint",
    "RemoteBlocks",
    "RemoteConfig",
    "RemoteStats",
    "StoreStats",
    "TierName",
    "TierUsage",
    "TieredStore",
    "TransferHandle",
    "ValkeyProcess",
    "chain_keys",
    "gds_available",
]
