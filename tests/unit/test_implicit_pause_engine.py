"""The implicit pause on the scheduler side (issue 41), with vLLM's own ``Request``: the
connector's ``implicit_pause`` setting or a request's ``implicit_pause`` field makes a finished
turn a pause whose answer rides in the turn's stats (``pause``), learned under the request's
``env`` (default ``params.IMPLICIT_PAUSE_ENV``). The manager's rules (queued next turn,
explicit wins) are in test_implicit_pause.py."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from agentkv_vllm import inprocess
from agentkv_vllm.params import IMPLICIT_PAUSE_ENV
from agentkv_vllm.scheduler_side import SchedulerSide
from agentkv_vllm.settings import ConnectorSettings
from tests.unit.test_engine_config import _vllm_config
from tests.unit.test_engine_identity import PROMPT, _request, _turn


def _side(**settings: Any) -> SchedulerSide:
    return SchedulerSide(*_vllm_config("cpu"), ConnectorSettings(**settings))


def test_the_setting_pauses_every_finished_turn_under_the_env_key() -> None:
    side = _side(implicit_pause=True)
    # A SkyRL-like request: only vLLM's session id names the trajectory, no agentkv params.
    reply = _turn(side, _request("s1", session_id="inst_0"))
    assert reply is not None
    pause = reply["agentkv"]["pause"]
    assert pause["implicit"] and pause["decision"]["action"], pause
    assert pause["wait_estimate"]["source"] == "prior"  # nothing learned, nothing declared
    _turn(side, _request("s2", session_id="inst_0", prompt=[*PROMPT, *range(200, 240)]))
    assert side.manager.predictor.tools() == {IMPLICIT_PAUSE_ENV: 1}  # the resume taught it
    assert side.manager.counters["implicit_pauses"] == 2


def test_without_the_setting_or_the_field_a_finished_turn_is_not_paused() -> None:
    side = _side()
    reply = _turn(side, _request("v1", session_id="inst_1"))
    assert reply is not None and "pause" not in reply["agentkv"]
    assert side.manager.table["inst_1"].branches["main"].paused_at is None
    assert side.manager.counters["implicit_pauses"] == 0


def test_the_request_field_wins_over_the_setting_and_names_the_environment() -> None:
    side = _side()
    on = inprocess.trajectory_params("r1", implicit_pause=True, env="sandbox")
    reply = _turn(side, _request("f1", kv=on))
    assert reply is not None and reply["agentkv"]["pause"]["implicit"]
    _turn(side, _request("f2", kv=on, prompt=[*PROMPT, *range(200, 240)]))
    assert side.manager.predictor.tools() == {"sandbox": 1}

    off = inprocess.trajectory_params("r2", implicit_pause=False)
    reply = _turn(_side(implicit_pause=True), _request("f3", kv=off))
    assert reply is not None and "pause" not in reply["agentkv"]


def test_a_request_that_names_its_pause_is_not_paused_implicitly() -> None:
    side = _side(implicit_pause=True)
    kv = inprocess.trajectory_params("p1", pause_after={"tool": "pytest", "expected_wait_s": 3})
    reply = _turn(side, _request("p1", kv=kv))
    assert reply is not None
    pause = reply["agentkv"]["pause"]
    assert "implicit" not in pause and pause["decision"]["action"], pause
    assert side.manager.counters["implicit_pauses"] == 0
    assert side.manager.table["p1"].branches["main"].tool == "pytest"
