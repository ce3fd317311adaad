"""The one tier model: where a copy of a KV block can live, and how far away that is.

Primitives:
    Tier          DEVICE | HOST | DISK | REMOTE (a StrEnum: each compares equal to its name)
    Locality      ENGINE (the engine's own memory), LOCAL (this replica's RAM and disk),
                  EXTERNAL (shared with other replicas; copies expire on their own, TTL)
    Tier.locality the locality of a tier
    LOCAL_TIERS   (HOST, DISK): the tiers this replica writes, evicts and indexes slot by slot
    WRITABLE      the tiers a pause decision or a job may name as a destination

Like vLLM's kv_offload ``Medium`` plus a locality: the manager, the store, the KV events, the
test simulation and ``agentkv simulate`` all name tiers with this enum, so a new tier is one
member here, not a string in five places. Dependency free (imported by the core and the plugin).
"""

from __future__ import annotations

import enum


class Locality(enum.StrEnum):
    ENGINE = "engine"  # the engine's device block pool: vLLM owns it, agentkv only pins
    LOCAL = "local"  # this replica's host RAM and local disk: indexed slot by slot, evicted by us
    EXTERNAL = "external"  # the shared remote tier: other replicas write it; copies expire (TTL)


class Tier(enum.StrEnum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"

    @property
    def locality(self) -> Locality:
        return _LOCALITY[self]


_LOCALITY = {
    Tier.DEVICE: Locality.ENGINE,
    Tier.HOST: Locality.LOCAL,
    Tier.DISK: Locality.LOCAL,
    Tier.REMOTE: Locality.EXTERNAL,
}
# Fastest first: the order a lookup prefers copies in.
LOCAL_TIERS: tuple[Tier, ...] = (Tier.HOST, Tier.DISK)
WRITABLE: tuple[Tier, ...] = (Tier.HOST, Tier.DISK, Tier.REMOTE)
