"""Eviction order: LRU, live leases last, pinned never."""

from __future__ import annotations

from agentkv.tiers.eviction import EvictionOrder


def make(leases: dict[str, float]) -> EvictionOrder[str]:
    order: EvictionOrder[str] = EvictionOrder(leases.get)
    for key in "abc":
        order.add(key)
    return order


def test_least_recently_used_goes_first_and_touch_refreshes() -> None:
    order = make({})
    assert order.victim(0.0) == "a"
    order.touch("a")
    assert order.victim(0.0) == "b"


def test_live_lease_goes_last_and_expired_lease_counts_as_none() -> None:
    leases = {"a": 10.0, "b": 10.0}
    order = make(leases)
    assert order.victim(now=5.0) == "c"
    order.remove("c")
    assert order.victim(now=5.0) == "a"  # only leased blocks left: LRU among them
    assert order.victim(now=11.0) == "a"
    leases["a"] = 20.0
    assert order.victim(now=11.0) == "b"


def test_pinned_blocks_are_never_victims() -> None:
    order = make({})
    for key in "abc":
        order.pin(key)
    assert order.victim(0.0) is None
    order.unpin("b")
    assert order.victim(0.0) == "b"
    assert order.pinned("a") and not order.pinned("b")
