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
  TierEvents.note_blocks(hashes, token_ids, session_id)
                                                a finished request's full blocks: each hash's
                                                parent, token ids and trajectory (first sighting)
  TierEvents.events(changes)                    the residency index's (key, tier, present) log ->
                                                BlockStored (medium CPU / STORAGE, chained runs,
                                                parents first) and BlockRemoved per tier
  TierEvents.reannounce(tier_keys)              every tier copy again, after the engine cleared
                                                its prefix cache (``AllBlocksCleared`` makes
                                                consumers forget this engine's blocks)

Invariants: a stored event's hashes are in chain order and its ``parent_block_hash`` is the
engine hash of the block before the first one (None at a prompt's start), so a consumer that saw
the engine's device events can chain it; token ids are the block's exact tokens. A key whose hash
or tokens were never noted (or were forgotten under the memory bound) is not announced stored,
never guessed. **Every announced copy's removal is announced**: once a copy is announced stored,
its key, hash and block info move out of the bounded notes into the live table, which holds
exactly the announced copies (so it is bounded by the tiers' capacity) until the last tier drops
the key. Notes are bounded by ``max_blocks`` (oldest go first).

Fields newer vLLMs added to the event classes are filled when the installed classes have them:
``session_id`` (the trajectory whose request first produced the run's first block), ``locality`` (``LOCAL``: the
copy is in this replica's own tier) and ``group_idx`` (0: agentkv tiers the first KV group).
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("agentkv.events")

MEDIUM_OF_TIER = {"host": "CPU", "disk": "STORAGE"}
LOCALITY = "LOCAL"
GROUP_IDX = 0


@dataclass(frozen=True)
class _Info:
    parent: bytes | None
    tokens: array[int]  # 4 bytes a token, not 28
    session_id: str | None = None


@dataclass
class _Live:
    """An announced copy: what its removal (and a re-announcement) needs, whatever the notes
    forgot since."""

    block_hash: bytes
    info: _Info | None
    tiers: set[str] = field(default_factory=set)


def _optional_fields(cls: Any, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` restricted to the fields the installed event class declares."""
    names = set(getattr(cls, "__struct_fields__", ()))
    return {k: v for k, v in values.items() if k in names}


class TierEvents:
    def __init__(self, block_size: int, max_blocks: int) -> None:
        self.block_size = block_size
        self.max_blocks = max(1024, max_blocks)
        self._hash_of: OrderedDict[bytes, bytes] = OrderedDict()
        self._info: OrderedDict[bytes, _Info] = OrderedDict()
        self._live: dict[bytes, _Live] = {}
        self.skipped = 0

    @property
    def live_copies(self) -> int:
        """Keys announced stored in at least one tier (pinned outside the bounded notes)."""
        return len(self._live)

    def note_key(self, key: bytes, block_hash: bytes) -> None:
        if key in self._hash_of or key in self._live:
            return
        self._hash_of[key] = block_hash
        if len(self._hash_of) > self.max_blocks:
            self._hash_of.popitem(last=False)

    def note_blocks(
        self,
        block_hashes: Sequence[Any],
        token_ids: Sequence[int],
        session_id: str | None = None,
    ) -> None:
        """Full blocks only: ``token_ids`` must cover ``len(block_hashes) * block_size``."""
        bs = self.block_size
        n = min(len(block_hashes), len(token_ids) // bs)
        parent: bytes | None = None
        for i in range(n):
            h = bytes(block_hashes[i])
            if h not in self._info:
                tokens = array("i", token_ids[i * bs : (i + 1) * bs])
                self._info[h] = _Info(parent, tokens, session_id)
                if len(self._info) > self.max_blocks:
                    self._info.popitem(last=False)
            parent = h

    def _hash(self, key: bytes) -> bytes | None:
        live = self._live.get(key)
        return live.block_hash if live is not None else self._hash_of.get(key)

    def _track(self, key: bytes, h: bytes, tier: str, present: bool) -> None:
        """Move a key between the notes and the live table as its copies come and go."""
        live = self._live.get(key)
        if present:
            if live is None:
                live = self._live[key] = _Live(h, self._info.get(h))
                self._hash_of.pop(key, None)
            elif live.info is None:
                live.info = self._info.get(h)
            live.tiers.add(tier)
        elif live is not None:
            live.tiers.discard(tier)
            if not live.tiers:
                del self._live[key]
                self.note_key(key, h)

    def events(self, changes: Iterable[tuple[bytes, str, bool]]) -> list[Any]:
        # The last change of a copy wins: a block stored and evicted within one batch is
        # announced removed only (removing what a consumer never saw is harmless).
        final: dict[tuple[str, bytes], bool] = {}
        for key, tier, present in changes:
            h = self._hash(key)
            if h is None:
                self.skipped += 1
                continue
            self._track(key, h, tier, present)
            final.pop((tier, h), None)
            final[(tier, h)] = present
        stored: dict[str, list[bytes]] = {}
        removed: dict[str, list[bytes]] = {}
        for (tier, h), present in final.items():
            (stored if present else removed).setdefault(tier, []).append(h)
        out: list[Any] = []
        from vllm.distributed.kv_events import BlockRemoved

        extra = _optional_fields(BlockRemoved, {"locality": LOCALITY, "group_idx": GROUP_IDX})
        for tier, hashes in removed.items():
            if hashes:
                out.append(
                    BlockRemoved(
                        block_hashes=[_external(h) for h in hashes],
                        medium=MEDIUM_OF_TIER[tier],
                        **extra,
                    )
                )
        for tier, hashes in stored.items():
            out.extend(self._stored(tier, hashes))
        return out

    def reannounce(self, tier_keys: dict[str, list[bytes]]) -> list[Any]:
        out: list[Any] = []
        for tier, keys in tier_keys.items():
            hashes = [h for k in keys if (h := self._hash(k)) is not None]
            out.extend(self._stored(tier, hashes))
        return out

    def _live_info(self) -> dict[bytes, _Info]:
        return {lv.block_hash: lv.info for lv in self._live.values() if lv.info is not None}

    def _stored(self, tier: str, hashes: list[bytes]) -> list[Any]:
        """One BlockStored per chained run, parents before children."""
        from vllm.distributed.kv_events import BlockStored

        pinned: dict[bytes, _Info] | None = None
        known: dict[bytes, _Info] = {}
        for h in dict.fromkeys(hashes):
            info = self._info.get(h)
            if info is None:
                pinned = self._live_info() if pinned is None else pinned
                info = pinned.get(h)
            if info is not None:
                known[h] = info
        self.skipped += len(set(hashes)) - len(known)
        children: dict[bytes | None, list[bytes]] = {}
        for h, info in known.items():
            children.setdefault(info.parent if info.parent in known else None, []).append(h)
        out = []
        for root in children.get(None, []):
            stack = [root]
            while stack:
                run = [stack.pop()]
                # Follow the first child to extend the run; branches start their own runs.
                while kids := children.get(run[-1]):
                    stack.extend(kids[1:])
                    run.append(kids[0])
                parent = known[run[0]].parent
                extra = _optional_fields(
                    BlockStored,
                    {
                        "locality": LOCALITY,
                        "session_id": known[run[0]].session_id,
                    },
                )
                out.append(
                    BlockStored(
                        block_hashes=[_external(h) for h in run],
                        parent_block_hash=_external(parent) if parent is not None else None,
                        token_ids=[t for h in run for t in known[h].tokens],
                        block_size=self.block_size,
                        lora_id=None,
                        medium=MEDIUM_OF_TIER[tier],
                        lora_name=None,
                        group_idx=GROUP_IDX,
                        **extra,
                    )
                )
        return out


def _external(block_hash: bytes) -> Any:
    """The hash as vLLM's own events carry it (an int unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    return maybe_convert_block_hash(BlockHash(block_hash))
