"""The implicit pause (issue 41): a finished turn of a caller that never pauses (an in-process RL
rollout) is a pause decided by the learned wait of the trajectory's environment
(``TrajectoryManager.pause_finished``), unless the branch's next request is already queued or a
pause came meanwhile (explicit wins). On the simulated engine; the plugin's wiring (the
``implicit_pause`` setting and request field) is in test_params.py and the e2e test
``tests/e2e/test_inprocess_e2e.py::test_an_implicit_pause_needs_no_pause_call``."""

from __future__ import annotations

from agentkv.manager import BranchState
from tests.unit.manager_helpers import P1, SYS, branch, counted
from tests.unit.sim_engine import Rig, make_rig

P2 = [*SYS, 5, 5, 5, 5, 6, 6, 6, 6, 2]  # another trajectory's 17 tokens


def _learn(rig: Rig, env: str, wait_s: float, n: int = 20) -> None:
    for _ in range(n):
        rig.mgr.predictor.observe(env, wait_s)


def test_a_finished_turn_is_paused_with_its_environment_s_learned_wait() -> None:
    rig = make_rig()
    _learn(rig, "quick-env", 0.001)
    _learn(rig, "slow-env", 300.0)
    rig.turn("t1", P1)
    rig.turn("t2", P2)
    assert branch(rig, "t1").state is BranchState.HELD  # nobody paused: the grace runs

    quick = rig.mgr.pause_finished("t1", "main", "quick-env")
    slow = rig.mgr.pause_finished("t2", "main", "slow-env")
    assert quick["implicit"] and quick["decision"]["action"] == "retain", quick
    assert quick["wait_estimate"]["source"] == "observed"  # learned, no declared wait
    assert slow["decision"]["action"] == "offload_host", slow
    assert branch(rig, "t1").state is BranchState.RETAINED
    assert branch(rig, "t1").tool == "quick-env"
    rig.settle()
    assert branch(rig, "t2").state is BranchState.OFFLOADED

    # The next turn resumes the pause: the environment's observed wait trains its key.
    rig.clock.advance(0.2)
    before = rig.mgr.predictor.tools()["quick-env"]
    second = rig.turn("t1", [*P1, 3, 3, 3])
    assert second.device_hit > 0
    assert rig.mgr.predictor.tools()["quick-env"] == before + 1
    assert counted(rig) == {"implicit_pauses": 2, "store_blocks": 4, "stores": 1}


def test_no_implicit_pause_when_the_branch_s_next_turn_is_already_queued() -> None:
    rig = make_rig()
    first = rig.eng.new_request("t1", "main", P1, max_new=1)
    queued = rig.eng.new_request("t1", "main", [*P1, 4, 4, 4], max_new=1)
    assert rig.eng.schedule(first) and rig.eng.schedule(queued)
    rig.run(first)

    reply = rig.mgr.pause_finished("t1", "main", "env")
    assert reply == {"implicit": True, "skipped": "running"}
    assert branch(rig).state is BranchState.ACTIVE and branch(rig).paused_at is None
    assert branch(rig).pending is None  # nothing waits to apply when the queued turn ends
    rig.run(queued)
    assert branch(rig).state is BranchState.HELD
    assert rig.mgr.counters["implicit_pause_skipped.running"] == 1
    assert rig.mgr.counters["implicit_pauses"] == 0


def test_an_explicit_pause_during_the_turn_wins_over_the_implicit_one() -> None:
    rig = make_rig()
    _learn(rig, "env", 0.001)  # the implicit pause would retain
    rig.turn("t1", P1)
    req = rig.eng.new_request("t1", "main", [*P1, 4, 4, 4], max_new=2)
    assert rig.eng.schedule(req)
    code, body = rig.mgr.pause("t1", "main", "human", 300.0)
    assert code == 200 and body["decision"]["action"] == "offload_host"
    rig.run(req)

    assert rig.mgr.pause_finished("t1", "main", "env") == {"implicit": True, "skipped": "paused"}
    assert branch(rig).tool == "human" and branch(rig).state is BranchState.OFFLOADING
    assert counted(rig) == {"implicit_pause_skipped.paused": 1, "store_blocks": 5, "stores": 1}


def test_an_explicit_pause_after_the_implicit_one_overrides_it() -> None:
    rig = make_rig()
    _learn(rig, "env", 0.001)
    rig.turn("t1", P1)
    assert rig.mgr.pause_finished("t1", "main", "env")["decision"]["action"] == "retain"
    code, body = rig.mgr.pause("t1", "main", "human", 300.0)
    assert code == 200 and body["decision"]["action"] == "offload_host"
    assert branch(rig).tool == "human"  # the resume teaches the explicit pause's tool
    rig.settle()
    assert branch(rig).state is BranchState.OFFLOADED


def test_an_implicit_pause_of_a_deleted_trajectory_is_skipped() -> None:
    rig = make_rig()
    rig.turn("t1", P1)
    assert rig.mgr.delete("t1")[0] == 200
    assert rig.mgr.pause_finished("t1", "main", "env") == {"implicit": True, "skipped": "unknown"}


def test_no_implicit_pause_while_a_request_of_the_trajectory_waits_to_start() -> None:
    """A request looked up and PENDING (here an admission wait: the trajectory's first turn had
    not finished when it came, the pool is over high water) is the next turn, queued."""
    rig = make_rig(admission_wait=True)
    first = rig.eng.new_request("t1", "main", P1, max_new=1)
    assert rig.eng.schedule(first)
    assert rig.eng.spike(rig.pool.num_free() - 1)  # the pool over high water
    waiting = rig.eng.new_request("t1", "main", [*P1, 4, 4, 4], max_new=1)
    assert not rig.eng.schedule(waiting)  # PENDING: vLLM asks again next step
    rig.run(first)

    reply = rig.mgr.pause_finished("t1", "main", "env")
    assert reply == {"implicit": True, "skipped": "queued"}
    assert branch(rig).paused_at is None
    assert rig.mgr.counters["implicit_pause_skipped.queued"] == 1
