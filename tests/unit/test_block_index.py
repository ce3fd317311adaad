"""BlockIndex: tiers, shared ownership, and counts that stay equal to a recount."""

from __future__ import annotations

import random

import pytest

from agentkv.block_index import BlockIndex


def _recount(index: BlockIndex, tier: str) -> int:
    return sum(1 for k in index if index.tier_of(k) == tier)


def test_shared_blocks_survive_until_their_last_owner_ends() -> None:
    idx = BlockIndex()
    idx.put(b"a", "host", "t1")
    idx.put(b"b", "host", "t1")
    idx.add_owner(b"a", "t2")  # t2 forked from t1: it relies on the shared head
    assert idx.owners(b"a") == {"t1", "t2"}
    assert sorted(idx.release("t1")) == [b"b"]  # only b is orphaned
    assert idx.tier_of(b"a") == "host" and idx.tier_of(b"b") is None
    assert idx.release("t2") == [b"a"]
    assert len(idx) == 0 and idx.count("host") == 0
    assert idx.release("t2") == []  # idempotent


def test_move_and_forget_keep_counts() -> None:
    idx = BlockIndex()
    idx.put(b"a", "disk", "t1")
    idx.put(b"b", "disk", "t1")
    assert (idx.count("disk"), idx.count("host")) == (2, 0)
    idx.move(b"a", "host")  # a prefetch
    assert (idx.count("disk"), idx.count("host")) == (1, 1)
    idx.put(b"b", "host", "t2")  # stored again to host by another owner: moves, adds owner
    assert (idx.count("disk"), idx.count("host")) == (0, 2)
    assert idx.forget(b"a") and not idx.forget(b"a")
    assert idx.count("host") == 1 and idx.keys_of("t1") == {b"b"}
    with pytest.raises(KeyError):
        idx.add_owner(b"zzz", "t1")


def test_counts_match_a_recount_under_random_operations() -> None:
    rng = random.Random(7)
    idx = BlockIndex()
    keys = [bytes([i]) for i in range(40)]
    owners = [f"t{i}" for i in range(5)]
    for _ in range(2000):
        op = rng.random()
        key, owner, tier = rng.choice(keys), rng.choice(owners), rng.choice(["host", "disk"])
        if op < 0.4:
            idx.put(key, tier, owner)
        elif op < 0.6 and key in idx:
            idx.move(key, tier)
        elif op < 0.75:
            idx.forget(key)
        elif op < 0.85:
            idx.release(owner)
        elif key in idx:
            idx.add_owner(key, owner)
        for t in ("host", "disk"):
            assert idx.count(t) == _recount(idx, t)
        assert all(k in idx for o in owners for k in idx.keys_of(o))
