"""Responses runs without a chain: the trajectory a resent conversation continues.

A Responses client may keep the conversation itself and resend all of it on every turn, with
no ``previous_response_id`` (the OpenAI Agents SDK's default): turn N+1's ``input`` is turn N's
``input``, then turn N's ``output`` items (the SDK's ``to_input_item``), then the new items (the
``function_call_output`` of each call, a user message). Without a hint every such request would
start a trajectory of its own (the chain's rule for a request without ``previous_response_id``)
that pauses once on its tool call and is never resumed. So the hooks remember, per served
response, a digest of its whole conversation (its request's input items followed by its output
items), and a request whose input *starts with* a remembered conversation continues that
response's trajectory and branch (``identified_by: responses_prefix``).

The match is exact on the items, after a normalization that only undoes what the client's
round trip changes: the top-level ``id``, ``status`` and ``created_by`` of an item are dropped
(the SDK drops placeholder ids and ``created_by``; a status is output-only), members whose value
is ``null`` count as missing (the SDK replays a parsed item with ``exclude_unset``, so a null
the server wrote comes back as a null, a field it left out stays out), and an item with a
``role`` and no ``type`` is a ``message`` (a string ``input`` is one user message). Call ids
stay: they tie each ``function_call_output`` to its call, and the server draws them at random,
so two runs' histories differ from their first tool call on. ``instructions``, tools and
sampling settings are not part of the match: a handoff to another agent (new instructions)
continues its run's trajectory.

Tenants: the digests are seeded with the request's tenant (the digest of its ``cache_salt``),
so a conversation is only ever continued by its own tenant (an unsalted one by unsalted
requests, as vLLM's prefix cache shares unsalted blocks).

Ambiguity: two runs whose histories are identical up to the resend (same input, same output:
text replies of a deterministic model, no tool call yet) store the same digest. The index then
cannot say whose run the next request is, so it continues neither: the digest is marked
ambiguous and a request matching it starts a new trajectory (the hooks count
``responses_prefix_ambiguous``). Merging two runs into one trajectory would interleave their
turns and pauses; a new trajectory costs only the continuity of that one run.

Cost: a request computes one digest per input item (O(size of the input), no scan of the
stored responses) and looks the digests up longest first; a reply extends its request's last
digest by its output items. One entry (~150 bytes) per stored response, least recently used
forgotten first beyond ``max_entries`` (the chain table's bound).

Primitives:
  conversation_digests(body, tenant) -> [d0, d1, ..., dn] | None   d0: the tenant's seed; dk:
                                 after the first k input items. None: the body cannot be
                                 matched (it names ``previous_response_id`` or a
                                 ``conversation``: its history is in the server's store)
  extend(digest, items) -> digest                 the digest after more items (the output)
  Stored(trajectory_id, branch, ambiguous)
  ConversationPrefixes(max_entries)
    .record(digest, trajectory_id, branch)
    .lookup(digests) -> Stored | None              the longest stored prefix
    .forget(digest)
  continued(chain, digests, prefixes, known, counters, timeout_s) -> Identity   the hooks'
                                 decision for a request that would start a new chain: the
                                 stored trajectory it continues (``responses_prefix``), or the
                                 new chain (no match; an ambiguous one; one the engine no
                                 longer holds: ``known`` answers False)

Everything but ``continued`` (which awaits the engine's answer) is pure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from agentkv.manager.state import tenant_digest
from agentkv_vllm.chains import DEFAULT_MAX_ENTRIES
from agentkv_vllm.identity import SRC_PREFIX, Identity

log = logging.getLogger("agentkv.hooks")

DIGEST_BYTES = 16
# What the client's round trip of an output item changes (see the module docstring).
_VOLATILE = frozenset({"id", "status", "created_by"})
_SEED = b"agentkv.responses_prefix.v1\0"


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def normalize_item(item: Any) -> Any:
    """One conversation item as the match compares it."""
    if not isinstance(item, dict):
        return _without_nulls(item)
    out = {k: _without_nulls(v) for k, v in item.items() if k not in _VOLATILE and v is not None}
    if "type" not in out and "role" in out:
        out["type"] = "message"
    return out


def _step(digest: bytes, item: Any) -> bytes:
    canon = json.dumps(
        normalize_item(item), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    h = hashlib.blake2b(digest, digest_size=DIGEST_BYTES)
    h.update(canon.encode("utf-8", "surrogatepass"))
    return h.digest()


def seed(tenant: str | None) -> bytes:
    """The empty conversation's digest in ``tenant``'s namespace (raw ``cache_salt``)."""
    name = tenant_digest(tenant).encode() if tenant else b""
    return hashlib.blake2b(_SEED + name, digest_size=DIGEST_BYTES).digest()


def extend(digest: bytes, items: Iterable[Any]) -> bytes:
    for item in items:
        digest = _step(digest, item)
    return digest


def conversation_digests(body: Any, tenant: str | None) -> list[bytes] | None:
    """The digests of the body's ``input`` after each of its items (index 0: none yet)."""
    if not isinstance(body, dict):
        return None
    if body.get("previous_response_id") is not None or body.get("conversation") is not None:
        return None
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list):
        return None
    out = [seed(tenant)]
    for item in items:
        out.append(_step(out[-1], item))
    return out


@dataclass(frozen=True)
class Stored:
    """The trajectory a stored conversation belongs to. ``ambiguous``: two trajectories stored
    this same conversation (the most recent is kept, but neither is continued)."""

    trajectory_id: str
    branch: str
    ambiguous: bool = False


class ConversationPrefixes:
    """Digest of a served response's whole conversation -> its trajectory (bounded, LRU)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max(1, max_entries)
        self._of: OrderedDict[bytes, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._of)

    def record(self, digest: bytes, trajectory_id: str, branch: str) -> None:
        with self._lock:
            old = self._of.get(digest)
            ambiguous = old is not None and (
                old.ambiguous or (old.trajectory_id, old.branch) != (trajectory_id, branch)
            )
            self._of[digest] = Stored(trajectory_id, branch, ambiguous)
            self._of.move_to_end(digest)
            while len(self._of) > self.max_entries:
                self._of.popitem(last=False)

    def lookup(self, digests: Sequence[bytes]) -> Stored | None:
        """The entry of the longest stored prefix among ``digests[1:]`` (an empty
        conversation matches nothing)."""
        with self._lock:
            for digest in reversed(digests[1:]):
                found = self._of.get(digest)
                if found is not None:
                    self._of.move_to_end(digest)  # an active run stays
                    return found
        return None

    def forget(self, digest: bytes) -> None:
        with self._lock:
            self._of.pop(digest, None)


async def continued(
    chain: Identity,
    digests: Sequence[bytes],
    prefixes: ConversationPrefixes,
    known: Callable[[str, str | None], Awaitable[bool]] | None,
    counters: Counter[str],
    timeout_s: float,
) -> Identity:
    """The trajectory a new chain's input continues, else the new chain ``chain``.

    ``known(trajectory_id, cache_salt)``: whether an engine still holds the trajectory; a
    DELETEd or expired one is not continued (counted ``responses_prefix_gone``). No answer in
    ``timeout_s`` is no evidence it is gone: the run continues, as a chain does unchecked
    (counted ``responses_prefix_check_failed``)."""
    stored = prefixes.lookup(digests)
    if stored is None:
        return chain
    if stored.ambiguous:
        counters["responses_prefix_ambiguous"] += 1
        return chain
    if known is not None:
        try:
            held = await asyncio.wait_for(
                known(stored.trajectory_id, chain.cache_salt), timeout=timeout_s
            )
        except Exception as exc:
            counters["responses_prefix_check_failed"] += 1
            log.warning("agentkv: is %s still held? no answer: %r", stored.trajectory_id, exc)
            held = True
        if not held:
            counters["responses_prefix_gone"] += 1
            return chain
    return dataclasses.replace(
        chain,
        trajectory_id=stored.trajectory_id,
        branch=stored.branch,
        source=SRC_PREFIX,
        request_id=None,  # vLLM names the response; the trajectory is the run's
    )


__all__ = [
    "ConversationPrefixes",
    "Stored",
    "continued",
    "conversation_digests",
    "extend",
    "normalize_item",
    "seed",
]
