"""A request's trajectory, resolved in the engine (issue 41): in-process callers (verl, OpenRLHF,
ROLL: ``AsyncLLM.generate`` with ``SamplingParams(extra_args=...)``) and vLLM routes the API
middleware does not hook (``/inference/v1/generate`` with ``X-Session-ID``) never pass through
the middleware, so the scheduler side reads what vLLM's ``Request`` carries itself:
``kv_transfer_params.agentkv``, else ``Request.session_id``, else a ``kv_hints`` action of type
``agentkv.trajectory``, else uni-agent's ``kv_transfer_params.agent_hint`` (its ``lease_until``
caps the trajectory's leases). Built with vLLM's own ``Request`` class."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.request import Request

from agentkv_vllm.params import (
    ENGINE_PRECEDENCE,
    KV_HINT_ACTION,
    KV_HINT_VERSION,
    IdentitySource,
    resolve_request_identity,
)
from agentkv_vllm.scheduler_side import SchedulerSide
from agentkv_vllm.settings import ConnectorSettings
from tests.unit.test_engine_config import BLOCK, _vllm_config

init_none_hash(sha256)
PROMPT = list(range(1, 101))


def _hints(payload: Any, action_type: str = KV_HINT_ACTION, version: str = KV_HINT_VERSION) -> Any:
    return KvHintsEnvelope(
        protocol_version="1",
        message_id="m1",
        actions=[
            KvHintAction("other", "kvcr.retain", "1", {"ttl_s": 5}),  # another component's
            KvHintAction("a1", action_type, version, payload),
        ],
    )


def _request(
    rid: str,
    *,
    kv: Any = None,
    session_id: str | None = None,
    kv_hints: Any = None,
    salt: str | None = None,
    prompt: list[int] = PROMPT,
) -> Request:
    extra = {"kv_transfer_params": kv} if kv is not None else None
    return Request(
        rid,
        list(prompt),
        SamplingParams(max_tokens=4, extra_args=extra),
        None,
        cache_salt=salt,
        session_id=session_id,
        kv_hints=kv_hints,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


@pytest.fixture
def side() -> SchedulerSide:
    return SchedulerSide(*_vllm_config("cpu"), ConnectorSettings())


def _turn(side: SchedulerSide, req: Request) -> dict[str, Any] | None:
    """One scheduled and finished request; its ``kv_transfer_params`` reply."""
    side.lookup(req, 0)
    n = -(-len(req.prompt_token_ids or []) // BLOCK)
    blocks = list(range(1, n + 1))
    side.plan_load(req, SimpleNamespace(get_block_ids=lambda: (blocks,)), 0)
    req.num_computed_tokens = req.num_tokens
    return side.finish(req, blocks)[1]


def test_precedence_is_params_then_session_id_then_kv_hints_then_agent_hint() -> None:
    assert ENGINE_PRECEDENCE == (
        IdentitySource.PARAMS,
        IdentitySource.SESSION_ID,
        IdentitySource.KV_HINTS,
        IdentitySource.AGENT_HINT,
    )
    every = {"agentkv": {"trajectory_id": "p"}, "agent_hint": {"trajectory_id": "a"}}
    hints = _hints({"trajectory_id": "h"})
    got = resolve_request_identity(every, "s", hints)
    assert (got.params and got.params.trajectory_id, got.source) == ("p", IdentitySource.PARAMS)
    got = resolve_request_identity({"agent_hint": {"trajectory_id": "a"}}, "s", hints)
    assert got.params and (got.params.trajectory_id, got.source) == ("s", "session_id")
    got = resolve_request_identity({"agent_hint": {"trajectory_id": "a"}}, None, hints)
    assert got.params and (got.params.trajectory_id, got.source) == ("h", "kv_hints")
    got = resolve_request_identity({"agent_hint": {"trajectory_id": "a", "lease_until": 9.0}})
    assert got.params and got.params.trajectory_id == "a" and got.lease_until == 9.0
    # Another connector's keys, another component's hint action: not agentkv's, vanilla.
    plain = resolve_request_identity({"do_remote_prefill": True}, None, _hints({}, "kvcr.x"))
    assert plain.params is None and plain.warning is None


@pytest.mark.parametrize(
    ("kv", "session_id", "hints", "source"),
    [
        ({"agentkv": {"trajectory_id": "a/b"}}, "fine", None, IdentitySource.PARAMS),
        ({"agentkv": "t1"}, None, None, IdentitySource.PARAMS),
        (None, "has space", None, IdentitySource.SESSION_ID),
        (None, None, {"trajectory_id": ""}, IdentitySource.KV_HINTS),
        (None, None, {"branch": "main"}, IdentitySource.KV_HINTS),
        ({"agent_hint": {"trajectory_id": "t", "lease_until": "soon"}}, None, None, "agent_hint"),
        ({"agent_hint": ["t"]}, None, None, IdentitySource.AGENT_HINT),
    ],
)
def test_a_malformed_source_is_vanilla_and_a_lower_one_is_not_tried(
    kv: Any, session_id: str | None, hints: Any, source: str
) -> None:
    env = _hints(hints) if hints is not None else None
    got = resolve_request_identity(kv, session_id, env)
    assert got.params is None and got.warning and got.kind
    assert got.source is not None and source in got.source.value


def test_a_kv_hints_action_of_another_version_is_malformed_not_guessed() -> None:
    got = resolve_request_identity(None, None, _hints({"trajectory_id": "t"}, version="2"))
    assert got.params is None and got.warning and "version" in got.warning


def test_an_in_process_session_names_the_trajectory_and_its_next_turn_resumes_it(
    side: SchedulerSide,
) -> None:
    """verl/OpenRLHF send a fresh request id per turn: the session id carries the trajectory."""
    first = _turn(side, _request("u1", session_id="inst_0"))
    assert first and first["agentkv"]["trajectory_id"] == "inst_0"
    assert first["agentkv"]["identified_by"] == "session_id"
    second = _turn(side, _request("u2", session_id="inst_0", prompt=[*PROMPT, *range(200, 240)]))
    assert second and second["agentkv"]["turn"] == 2
    assert side.status()["counters"]["identified.session_id"] == 2


def test_a_kv_hints_payload_is_the_agentkv_params_pause_after_included(
    side: SchedulerSide,
) -> None:
    payload = {"trajectory_id": "hinted", "pause_after": {"tool": "sandbox", "expected_wait_s": 2}}
    reply = _turn(side, _request("k1", kv_hints=_hints(payload)))
    assert reply is not None
    stats = reply["agentkv"]
    assert stats["identified_by"] == "kv_hints" and stats["trajectory_id"] == "hinted"
    assert stats["pause"]["decision"]["action"]  # the pause that follows the turn was applied


def test_explicit_params_win_over_the_session_id_vllm_also_sets(side: SchedulerSide) -> None:
    """The middleware injects ``kv_transfer_params.agentkv`` from the same session hint vLLM
    maps to ``Request.session_id``: one trajectory, counted once, under the params."""
    kv = {"agentkv": {"trajectory_id": "sess"}}
    reply = _turn(side, _request("m1", kv=kv, session_id="sess"))
    assert reply and reply["agentkv"]["identified_by"] == IdentitySource.PARAMS.value
    counters = side.status()["counters"]
    assert counters["identified.kv_transfer_params.agentkv"] == 1
    assert counters["identified.session_id"] == 0


def test_malformed_hints_are_vanilla_warned_once_per_kind_and_counted_per_request(
    side: SchedulerSide, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="agentkv.scheduler")
    for i in range(3):
        req = _request(f"bad{i}", session_id=f"bad id {i}")
        assert side.lookup(req, 0) == (0, False)
        side.lookup(req, 0)  # a waiting request is looked up again: still one count
        assert side.finish(req, [])[1] is None
    req = _request("bad-hint", kv={"agent_hint": {"trajectory_id": "t", "lease_until": -1}})
    side.lookup(req, 0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([w for w in warnings if "session_id" in w]) == 1
    assert len([w for w in warnings if "agent_hint" in w]) == 1
    counters = side.status()["counters"]
    assert counters["malformed.session_id"] == 3
    assert counters["malformed.kv_transfer_params.agent_hint"] == 1
    assert side.status()["trajectories"] == 0


def test_an_agent_hint_lease_until_caps_the_lease_of_the_trajectory_s_pause() -> None:
    # Every pause retains (for the server's max_lease_s unless capped): the cap is what differs.
    side = SchedulerSide(*_vllm_config("cpu"), ConnectorSettings(policy_override="retain"))
    until = time.time() + 5.0
    kv = {"agent_hint": {"trajectory_id": "ua", "priority": 1, "lease_until": until}}
    reply = _turn(side, _request("a1", kv=kv))
    assert reply and reply["agentkv"]["identified_by"] == "kv_transfer_params.agent_hint"
    status, body = side.handle(
        {"op": "pause", "trajectory_id": "ua", "tool": "quick", "expected_wait_s": 0.5}
    )
    assert status == 200, body
    decision = body["decision"]
    assert decision["action"] == "retain", decision
    assert 0 < decision["lease_s"] <= 5.0, decision
    # A trajectory without an agent_hint keeps the server's lease.
    _turn(side, _request("b1", session_id="other"))
    _, body = side.handle(
        {"op": "pause", "trajectory_id": "other", "tool": "quick", "expected_wait_s": 0.5}
    )
    assert body["decision"]["lease_s"] > 5.0, body
    # A DELETE forgets the lease: the id's next trajectory is not capped by the old hint.
    assert side.handle({"op": "end", "trajectory_id": "ua"})[0] == 200
    _turn(side, _request("a2", session_id="ua"))
    _, body = side.handle(
        {"op": "pause", "trajectory_id": "ua", "tool": "quick", "expected_wait_s": 0.5}
    )
    assert body["decision"]["lease_s"] > 5.0, body


def test_the_in_process_params_are_what_the_engine_reads() -> None:
    from pydantic import ValidationError

    from agentkv_vllm import inprocess

    extra = inprocess.extra_args(
        "traj-1",
        pause_after={"tool": "sandbox", "expected_wait_s": 4},
        extra={"kv_transfer_params": {"do_remote_prefill": False}, "mine": 1},
    )
    assert extra["mine"] == 1 and extra["kv_transfer_params"]["do_remote_prefill"] is False
    got = resolve_request_identity(extra["kv_transfer_params"])
    assert got.source is IdentitySource.PARAMS and got.params is not None
    assert got.params.trajectory_id == "traj-1" and got.params.pause_after is not None
    assert got.params.pause_after.expected_wait_s == 4
    with pytest.raises(ValidationError):
        inprocess.trajectory_params("a/b")  # refused at the caller, not served vanilla later
    stats = {"turn": 2, "tier_hit_tokens": 256}
    assert inprocess.turn_stats(SimpleNamespace(kv_transfer_params={"agentkv": stats})) == stats
    assert inprocess.turn_stats(SimpleNamespace(kv_transfer_params=None)) is None


def test_the_in_process_control_endpoint_is_the_connector_s(tmp_path: Any) -> None:
    from agentkv_vllm import inprocess

    extra = {"run_dir": str(tmp_path)}
    ktc = SimpleNamespace(engine_id="e-1", kv_connector_extra_config=extra)
    engine = SimpleNamespace(
        vllm_config=SimpleNamespace(
            kv_transfer_config=ktc, parallel_config=SimpleNamespace(data_parallel_size=2)
        )
    )
    settings = ConnectorSettings.model_validate(extra)
    # The engine cores see "e-1_dp<r>" (vLLM appends it); the connector strips it back.
    assert inprocess._control_endpoints(engine) == [
        settings.control_endpoint("e-1", 0),
        settings.control_endpoint("e-1", 1),
    ]
