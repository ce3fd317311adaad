"""``policy_override``: the connector knob behind the bench's retain-always / offload-always
configurations. Every pause takes the fixed action whatever the policy decides."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agentkv.manager import BranchState
from tests.unit.sim_engine import make_rig

P1 = [7, 7, 7, 7, 9, 9, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 1]  # 4 full blocks of 4 tokens


def _paused(override: str | None, tool: str, wait: float | None) -> dict:
    rig = make_rig(policy_override=override)
    rig.turn("t1", P1)
    code, body = rig.mgr.pause("t1", "main", tool, wait)
    assert code == 200, body
    rig.settle()
    body["final_state"] = rig.mgr.table["t1"].branches["main"].state
    body["lease_until"] = rig.mgr.table["t1"].branches["main"].lease_until
    body["max_lease_s"] = rig.mgr.policy.max_lease_s
    return body


def test_without_override_the_policy_decides() -> None:
    # A 400 s wait offloads; a 1 ms wait retains (the rig's costs): the two fixed policies differ.
    assert _paused(None, "human", 400.0)["decision"]["action"] == "offload_host"
    assert _paused(None, "fast", 0.001)["decision"]["action"] == "retain"


def test_retain_always_retains_a_long_wait_for_the_longest_lease() -> None:
    body = _paused("retain", "human", 400.0)
    assert body["decision"]["action"] == "retain"
    assert "policy_override" in body["decision"]["rationale"]
    assert body["decision"]["lease_s"] == body["max_lease_s"]
    assert body["final_state"] is BranchState.RETAINED


def test_offload_always_writes_back_a_short_wait() -> None:
    body = _paused("offload_host", "fast", 0.001)
    assert body["decision"]["action"] == "offload_host"
    assert body["final_state"] is BranchState.OFFLOADED


def test_the_setting_is_validated() -> None:
    from agentkv_vllm.settings import ConnectorSettings

    assert ConnectorSettings().policy_override is None
    assert ConnectorSettings(policy_override="retain").policy_override == "retain"
    with pytest.raises(ValidationError, match="policy_override"):
        ConnectorSettings(policy_override="always")
