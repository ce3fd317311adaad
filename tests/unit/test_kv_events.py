"""Tier KV events from the residency index's change log (the adapter's TierEvents)."""

from __future__ import annotations

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from agentkv_vllm.kv_events import TierEvents

BS = 2


def ext(h: bytes) -> object:
    return maybe_convert_block_hash(BlockHash(h))


def setup() -> tuple[TierEvents, list[bytes]]:
    events = TierEvents(BS, max_blocks=100)
    hashes = [bytes([i]) * 32 for i in range(4)]
    events.note_blocks(hashes, list(range(1, 9)))
    for i, h in enumerate(hashes):
        events.note_key(b"k%d" % i, h)
    return events, hashes


def test_a_chain_is_one_event_with_the_engine_hashes_parent_and_tokens() -> None:
    events, hashes = setup()
    out = events.events([(b"k1", "host", True), (b"k2", "host", True), (b"k3", "host", True)])
    assert len(out) == 1 and isinstance(out[0], BlockStored)
    e = out[0]
    assert e.medium == "CPU" and e.block_size == BS
    assert e.block_hashes == [ext(h) for h in hashes[1:]]
    assert e.parent_block_hash == ext(hashes[0])  # the block before the run: chains to the device
    assert e.token_ids == [3, 4, 5, 6, 7, 8]


def test_last_change_wins_and_tiers_map_to_media() -> None:
    events, hashes = setup()
    out = events.events([(b"k0", "host", True), (b"k1", "disk", True), (b"k0", "host", False)])
    removed = [e for e in out if isinstance(e, BlockRemoved)]
    stored = [e for e in out if isinstance(e, BlockStored)]
    assert [(e.medium, e.block_hashes) for e in removed] == [("CPU", [ext(hashes[0])])]
    assert [(e.medium, e.block_hashes) for e in stored] == [("STORAGE", [ext(hashes[1])])]


def test_unknown_keys_are_skipped_never_guessed() -> None:
    events, _ = setup()
    assert events.events([(b"nope", "host", True)]) == []
    assert events.skipped == 1


def test_reannounce_after_a_cache_reset_lists_every_tier_copy() -> None:
    events, hashes = setup()
    out = events.reannounce({"host": [b"k0", b"k1"], "disk": [b"k3"]})
    assert [(e.medium, len(e.block_hashes)) for e in out] == [("CPU", 2), ("STORAGE", 1)]
    assert out[0].parent_block_hash is None and out[1].parent_block_hash == ext(hashes[2])


def test_a_removal_is_announced_even_after_its_note_was_evicted() -> None:
    """Issue 25 item 8: a stored copy's removal must reach the router even when the bounded
    note table forgot the key meanwhile (else it keeps crediting a copy that is gone)."""
    events, hashes = setup()
    assert len(events.events([(b"k0", "host", True)])) == 1
    for i in range(2 * events.max_blocks):  # churn: notes of other keys push k0's note out
        events.note_key(b"other%d" % i, i.to_bytes(32, "big"))
    out = events.events([(b"k0", "host", False)])
    assert [(type(e), e.medium, e.block_hashes) for e in out] == [
        (BlockRemoved, "CPU", [ext(hashes[0])])
    ]
    # once removed everywhere the key is no longer pinned: memory stays bounded
    assert events.live_copies == 0


def test_a_copy_in_two_tiers_stays_pinned_until_both_are_gone() -> None:
    events, hashes = setup()
    events.events([(b"k1", "host", True), (b"k1", "disk", True)])
    for i in range(2 * events.max_blocks):
        events.note_key(b"other%d" % i, i.to_bytes(32, "big"))
    first = events.events([(b"k1", "host", False)])
    assert [(e.medium, e.block_hashes) for e in first] == [("CPU", [ext(hashes[1])])]
    second = events.events([(b"k1", "disk", False)])
    assert [(e.medium, e.block_hashes) for e in second] == [("STORAGE", [ext(hashes[1])])]
    assert events.live_copies == 0


def test_reannounce_survives_evicted_notes_of_live_copies() -> None:
    events, hashes = setup()
    events.events([(b"k0", "host", True), (b"k1", "host", True)])
    for i in range(2 * events.max_blocks):
        events.note_blocks([i.to_bytes(32, "big")], [1, 2])
        events.note_key(b"other%d" % i, i.to_bytes(32, "big"))
    out = events.reannounce({"host": [b"k0", b"k1"]})
    assert [(e.block_hashes, e.token_ids) for e in out] == [
        ([ext(hashes[0]), ext(hashes[1])], [1, 2, 3, 4])
    ]


def test_tier_events_carry_session_locality_and_group() -> None:
    """vLLM's newer event fields: the trajectory as session_id, LOCAL locality, group 0."""
    events = TierEvents(BS, max_blocks=100)
    h = [bytes([9]) * 32, bytes([8]) * 32]
    events.note_blocks(h, [1, 2, 3, 4], session_id="traj-1")
    events.note_key(b"a", h[0])
    events.note_key(b"b", h[1])
    (stored,) = events.events([(b"a", "host", True), (b"b", "host", True)])
    assert (stored.session_id, stored.locality, stored.group_idx) == ("traj-1", "LOCAL", 0)
    (removed,) = events.events([(b"a", "host", False)])
    assert (removed.locality, removed.group_idx) == ("LOCAL", 0)
