from __future__ import annotations

from agentkv.trajectories import BranchState, TrajectoryTable, TurnStats


def test_expired_covers_grace_and_lease() -> None:
    table = TrajectoryTable()
    t = table.get_or_create("a", now=0)
    held = t.branch("h")
    held.state, held.held_until = BranchState.HELD, 5
    kept = t.branch("r")
    kept.state, kept.lease_until = BranchState.RETAINED, 10
    assert table.expired(4) == []
    assert [b.name for _, b in table.expired(6)] == ["h"]
    assert sorted(b.name for _, b in table.expired(11)) == ["h", "r"]


def test_pressure_victims_farthest_return_first() -> None:
    table = TrajectoryTable()
    for name, ret in (("soon", 10.0), ("late", 500.0), ("mid", 60.0)):
        b = table.get_or_create(name, now=0).branch("main")
        b.state, b.predicted_return_at = BranchState.RETAINED, ret
    off = table.get_or_create("off", now=0).branch("main")
    off.state, off.predicted_return_at = BranchState.OFFLOADED, 9999.0
    assert [t.trajectory_id for t, _ in table.pressure_victims()] == ["late", "mid", "soon"]


def test_prefix_hit_ratio_ignores_each_branch_first_turn() -> None:
    t = TrajectoryTable().get_or_create("x", now=0)
    t.turns = [
        TurnStats(1, "main", 1000),
        TurnStats(2, "main", 1200, device_hit_tokens=900, tier_hit_tokens=100),
        TurnStats(3, "b", 1300),
    ]
    assert t.prefix_hit_ratio == 1000 / 1200
    assert t.to_dict(0)["turns"][1]["hit_ratio"] == round(1000 / 1200, 6)


def test_count_by_state() -> None:
    table = TrajectoryTable()
    table.get_or_create("a", 0).branch("main").state = BranchState.OFFLOADED
    table.get_or_create("b", 0).branch("main")
    counts = table.count_by_state()
    assert counts["offloaded"] == 1 and counts["active"] == 1
