"""vLLM KV events for the blocks agentkv holds in its host and disk tiers.

Routers that score replicas by cached prefix (vllm-router's ``kv_aware``, llm-d, Dynamo) learn
what each engine holds from vLLM's KV events (``--kv-events-config``): ``BlockStored`` and
``BlockRemoved`` with the engine's own block hashes, the parent chain and the exact token ids.
vLLM announces its device blocks (``medium`` GPU); this module announces agentkv's tier copies
from the connector's ``take_events()`` so that a paused trajectory offloaded to host RAM still
draws its next turn to this replica (vllm-router credits host and disk hits with
``--kv-penalty-host`` / ``--kv-penalty-disk``).

Primitives:
  TierEvents.note_key(key, block_hash)          tier key -> the engine's block hash (the adapter
                                                maps each hash once; this remembers the pair)
  TierEvents.note_blocks(hashes, token_ids)     a finished request's full blocks: each hash's
                                                parent and token ids (first sighting only)
  TierEvents.events(changes)                    the residency index's (key, tier, present) log ->
                                                BlockStored (medium CPU / STORAGE, chained runs,
                                                parents first) and BlockRemoved per tier
  TierEvents.reannounce(tier_keys)              every tier copy again, after the engine cleared
                                                its prefix cache (``AllBlocksCleared`` makes
                                                consumers forget this engine's blocks)

Invariants: a stored event's hashes are in chain order and its ``parent_block_hash`` is the
engine hash of the block before the first one (None at a prompt's start), so a consumer that saw
the engine's device events can chain it; token ids are the block's exact tokens. A key whose hash
or tokens were never noted (or were forgotten under the memory bound) is skipped, never guessed.
Memory is bounded by ``max_blocks`` (oldest notes go first).
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

log = logging.getLogger("agentkv.events")

MEDIUM_OF_TIER = {"host": "CPU", "disk": "STORAGE"}


class TierEvents:
    def __init__(self, block_size: int, max_blocks: int) -> None:
        self.block_size = block_size
        self.max_blocks = max(1024, max_blocks)
        self._hash_of: OrderedDict[bytes, bytes] = OrderedDict()
        # engine hash -> (parent hash or None, the block's token ids; 4 bytes each, not 28)
        self._info: OrderedDict[bytes, tuple[bytes | None, array[int]]] = OrderedDict()
        self.skipped = 0

    def note_key(self, key: bytes, block_hash: bytes) -> None:
        if key in self._hash_of:
            return
        self._hash_of[key] = block_hash
        if len(self._hash_of) > self.max_blocks:
            self._hash_of.popitem(last=False)

    def note_blocks(self, block_hashes: Sequence[Any], token_ids: Sequence[int]) -> None:
        """Full blocks only: ``token_ids`` must cover ``len(block_hashes) * block_size``."""
        bs = self.block_size
        n = min(len(block_hashes), len(token_ids) // bs)
        parent: bytes | None = None
        for i in range(n):
            h = bytes(block_hashes[i])
            if h not in self._info:
                self._info[h] = (parent, array("i", token_ids[i * bs : (i + 1) * bs]))
                if len(self._info) > self.max_blocks:
                    self._info.popitem(last=False)
            parent = h

    def events(self, changes: Iterable[tuple[bytes, str, bool]]) -> list[Any]:
        # The last change of a copy wins: a block stored and evicted within one batch is
        # announced removed only (removing what a consumer never saw is harmless).
        final: dict[tuple[str, bytes], bool] = {}
        for key, tier, present in changes:
            h = self._hash_of.get(key)
            if h is None:
                self.skipped += 1
                continue
            final.pop((tier, h), None)
            final[(tier, h)] = present
        stored: dict[str, list[bytes]] = {}
        removed: dict[str, list[bytes]] = {}
        for (tier, h), present in final.items():
            (stored if present else removed).setdefault(tier, []).append(h)
        out: list[Any] = []
        from vllm.distributed.kv_events import BlockRemoved

        for tier, hashes in removed.items():
            if hashes:
                out.append(
                    BlockRemoved(
                        block_hashes=[_external(h) for h in hashes], medium=MEDIUM_OF_TIER[tier]
                    )
                )
        for tier, hashes in stored.items():
            out.extend(self._stored(tier, hashes))
        return out

    def reannounce(self, tier_keys: dict[str, list[bytes]]) -> list[Any]:
        out: list[Any] = []
        for tier, keys in tier_keys.items():
            hashes = [h for k in keys if (h := self._hash_of.get(k)) is not None]
            out.extend(self._stored(tier, hashes))
        return out

    def _stored(self, tier: str, hashes: list[bytes]) -> list[Any]:
        """One BlockStored per chained run, parents before children."""
        from vllm.distributed.kv_events import BlockStored

        known = {h: self._info[h] for h in dict.fromkeys(hashes) if h in self._info}
        self.skipped += len(set(hashes)) - len(known)
        children: dict[bytes | None, list[bytes]] = {}
        for h, (parent, _) in known.items():
            children.setdefault(parent if parent in known else None, []).append(h)
        out = []
        for root in children.get(None, []):
            stack = [root]
            while stack:
                run = [stack.pop()]
                # Follow the first child to extend the run; branches start their own runs.
                while kids := children.get(run[-1]):
                    stack.extend(kids[1:])
                    run.append(kids[0])
                parent = known[run[0]][0]
                out.append(
                    BlockStored(
                        block_hashes=[_external(h) for h in run],
                        parent_block_hash=_external(parent) if parent is not None else None,
                        token_ids=[t for h in run for t in known[h][1]],
                        block_size=self.block_size,
                        lora_id=None,
                        medium=MEDIUM_OF_TIER[tier],
                        lora_name=None,
                        group_idx=0,
                    )
                )
        return out


def _external(block_hash: bytes) -> Any:
    """The hash as vLLM's own events carry it (an int unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    return maybe_convert_block_hash(BlockHash(block_hash))
