"""Shared helpers of the test_manager*.py files: two prompts and ready-made states of the rig.

The rig (sim_engine.make_rig): 4-token blocks, a 40-block pool, 1 MiB blocks (a 4-block context
reloads from host in 0.04 s and recomputes in 0.17 s), grace 0.5 s, job timeout 10 s.

Primitives:
    SYS, P1          two blocks every trajectory shares; a 17-token prompt (4 full blocks).
    keys_of          the tier keys of a token list on the rig.
    in_thread        run a call on another thread (the control channel) and return its result.
    offloaded        one finished turn whose grace expired and host copy was written.
    disk_offloaded   a finished turn paused long enough to go to disk.
    branch           a trajectory's branch by client id and tenant.
    counted          the counters that moved, to assert exactly.
    assert_answers   /status, metrics and GET of trajectories equal the test's entry in
                     manager_answers.json (AGENTKV_UPDATE_ANSWERS=1 rewrites it; review the diff).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from agentkv.manager import BranchState
from agentkv.manager.state import Branch, scoped_id
from tests.unit.sim_engine import Rig, key_of

SYS = [7, 7, 7, 7, 9, 9, 9, 9]  # two blocks every trajectory shares
P1 = [*SYS, 1, 2, 3, 4, 5, 6, 7, 8, 1]  # 17 tokens: 4 full blocks


def keys_of(rig: Rig, tokens: list[int]) -> list[bytes]:
    return [key_of(h) for h in rig.eng.hashes(tokens)]


def in_thread(fn: Any, *args: Any) -> Any:
    """Run ``fn`` on another thread (the control channel), return its result."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join()
    return out[0]


def offloaded(rig: Rig, traj: str = "t1", prompt: list[int] = P1) -> None:
    """One finished turn of ``traj``, its grace expired, its host copy written."""
    rig.turn(traj, prompt)
    rig.clock.advance(1.0)
    rig.settle()
    assert rig.mgr.table[traj].branches["main"].state is BranchState.OFFLOADED


def branch(rig: Rig, traj: str = "t1", name: str = "main", tenant: str | None = None) -> Branch:
    return rig.mgr.table[scoped_id(traj, tenant)].branches[name]


def disk_offloaded(rig: Rig, wait: float = 400.0) -> dict[str, Any]:
    rig.turn("t1", P1)
    code, body = rig.mgr.pause("t1", "main", "human", wait)
    assert code == 200 and body["decision"]["action"] == "offload_disk", body
    rig.settle()
    assert branch(rig).state is BranchState.OFFLOADED and branch(rig).tier == "disk"
    return body


def counted(rig: Rig) -> dict[str, int]:
    """The manager's counters that moved (a scenario asserts all of them at once, so a counter
    counted wrong, twice, under another name or not at all fails it)."""
    return {k: v for k, v in sorted(rig.mgr.counters.items()) if v != 0}


ANSWERS = Path(__file__).with_name("manager_answers.json")


def assert_answers(rig: Rig, *trajectories: str, **replies: Any) -> None:
    """/status (its counters: ``counted``'s), the metrics and the GET of each named trajectory
    equal what manager_answers.json holds for the running test: every field the control channel
    and the scrape answer, pinned to its exact value; ``replies``: earlier replies the test kept
    (a pause's, a resume's), pinned the same way. ``AGENTKV_UPDATE_ANSWERS=1`` stores what the code answers
    instead (run serially; review the file's diff: it is the behaviour change)."""
    status = rig.mgr.status()
    status["counters"] = {k: v for k, v in sorted(status["counters"].items()) if v != 0}
    got = {"status": status, "metrics": rig.mgr.metrics.snapshot()}
    got = json.loads(json.dumps({**got, **{t: rig.mgr.get(t)[1] for t in trajectories}, **replies}))
    # "test_file.py::name": the file's name only, so a run from another root (mutmut's copy)
    # finds the same entry
    path, name = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0].split("::", 1)
    test = f"{Path(path).name}::{name}"
    stored = json.loads(ANSWERS.read_text()) if ANSWERS.exists() else {}
    if os.environ.get("AGENTKV_UPDATE_ANSWERS") == "1":
        stored[test] = got
        ANSWERS.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
        return
    assert test in stored, f"no stored answers for {test}: run it with AGENTKV_UPDATE_ANSWERS=1"
    assert got == stored[test]
