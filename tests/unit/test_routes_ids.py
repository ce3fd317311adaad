"""The agentkv routes apply the id grammar of agentkv.ids to path ids and body branches: 422
naming the field, even under vLLM's exception handlers (which turn FastAPI validation into 400).

FastAPI TestClient in-process; no server, no engine (the control client is absent, so a valid id
gets the routes' 503 'connector is not enabled').
"""

from __future__ import annotations

import asyncio
from argparse import Namespace
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

from fastapi import FastAPI
from fastapi.testclient import TestClient
from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

from agentkv.ids import MAX_ID_LEN
from agentkv_vllm import routes

BASE = "/agentkv/v1/trajectories"


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.setattr(routes._State, "client", None)
    monkeypatch.setattr(routes._State, "api_keys", [])
    monkeypatch.setattr(routes._State, "engine_client", None)
    app = FastAPI()
    init_exception_handler(app)  # as vLLM's OpenAI server does
    app.state.args = Namespace(log_error_stack=False)
    routes.AgentKVRoutes().attach_router(app)
    with TestClient(app) as c:
        yield c


def _call(c: TestClient, op: str, tid: str, body: Any = None) -> Any:
    if op == "pause":
        return c.post(f"{BASE}/{tid}/pause", json=body or {"tool": "pytest"})
    if op == "resume":
        return c.post(f"{BASE}/{tid}/resume", json=body or {})
    if op == "end":
        return c.delete(f"{BASE}/{tid}")
    return c.get(f"{BASE}/{tid}")


@pytest.mark.parametrize("op", ["pause", "resume", "end", "get"])
@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ("a%20b", "' '"),
        ("x" * (MAX_ID_LEN + 1), "257 characters"),
        ("%C3%A9", "'é'"),
        ("t%3F", "'?'"),
    ],
)
def test_path_id_outside_the_grammar_is_422_naming_the_field(
    client: TestClient, op: str, raw: str, named: str
) -> None:
    r = _call(client, op, raw)
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["detail"].startswith("invalid path.trajectory_id: ")
    assert named in body["detail"]
    assert body["errors"][0]["loc"] == ["path", "trajectory_id"]
    assert body["errors"][0]["type"] == "invalid_id"


@pytest.mark.parametrize("op", ["pause", "resume", "end", "get"])
def test_valid_path_id_reaches_the_control_call(client: TestClient, op: str) -> None:
    r = _call(client, op, "user@host:run-1.2_x")
    assert r.status_code == 503 and "not enabled" in r.text


@pytest.mark.parametrize("op", ["pause", "resume"])
@pytest.mark.parametrize("branch", ["main/retry", ".", "..", "a b", ""])
def test_body_branch_outside_the_grammar_is_422(client: TestClient, op: str, branch: str) -> None:
    body: dict[str, Any] = {"branch": branch}
    if op == "pause":
        body["tool"] = "pytest"
    r = _call(client, op, "t1", body)
    assert r.status_code == 422, r.text
    assert r.json()["detail"].startswith("invalid branch: ")
    assert r.json()["errors"][0]["loc"] == ["branch"]


def test_a_slash_never_reaches_a_handler(client: TestClient) -> None:
    """Why the grammar excludes '/': the route does not even match (encoded or not)."""
    for raw in ("team/run-1", "team%2Frun-1"):
        assert client.post(f"{BASE}/{raw}/pause", json={"tool": "t"}).status_code == 404


def test_openapi_documents_the_grammar(client: TestClient) -> None:
    from agentkv.ids import ID_PATTERN

    spec = client.get("/openapi.json").json()
    param = spec["paths"][f"{BASE}/{{trajectory_id}}/pause"]["post"]["parameters"][0]
    assert param["schema"]["pattern"] == ID_PATTERN


class _FakeRank:
    """A DP rank's control channel: the trajectories it holds, the calls it got."""

    def __init__(self, holds: dict[str | None, set[str]]) -> None:
        self.holds = holds  # cache_salt -> trajectory ids
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def call(self, op: str, **fields: Any) -> tuple[int, dict[str, Any]]:
        self.calls.append((op, fields))
        tid = fields.get("trajectory_id")
        ids = self.holds.get(fields.get("cache_salt"), set())
        if tid not in ids:
            return 404, {"detail": f"unknown trajectory {tid!r}"}
        if op == "end":
            ids.discard(tid)
            return 200, {"trajectory_id": tid, "released_blocks": 1, "dropped_tier_blocks": 2}
        return 200, {"trajectory_id": tid}


def test_trajectory_ops_reach_every_dp_rank_and_name_the_tenant(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DELETE reaches every DP rank that holds the id (issue 25: it stopped at the first) and
    sums what they released; the X-AgentKV-Cache-Salt header names the tenant's namespace."""
    ranks = [_FakeRank({None: {"t1"}}), _FakeRank({None: {"t1"}, "s": {"t1"}})]
    monkeypatch.setattr(routes._State, "clients", ranks)
    monkeypatch.setattr(routes._State, "client", ranks[0])
    r = client.get(f"{BASE}/t1", headers={routes.TENANT_HEADER: "s"})
    assert r.status_code == 200 and r.json()["dp_ranks"] == [1]
    assert ranks[0].calls[-1] == ("get", {"trajectory_id": "t1", "cache_salt": "s"})
    r = client.delete(f"{BASE}/t1")
    assert r.status_code == 200
    assert r.json()["dropped_tier_blocks"] == 4 and r.json()["dp_ranks"] == [0, 1]
    assert ranks[1].holds == {None: set(), "s": {"t1"}}  # the tenant's own t1 stays
    assert client.delete(f"{BASE}/t1").status_code == 404
    r = client.delete(f"{BASE}/t1", headers={routes.TENANT_HEADER: "s"})
    assert r.status_code == 200 and r.json()["dp_ranks"] == [1]


class _KeyedRank(_FakeRank):
    """A rank that replays an answer when it sees a key again (as the engine's ReplayCache)."""

    def __init__(self, holds: dict[str | None, set[str]]) -> None:
        super().__init__(holds)
        self.seen: dict[str, tuple[int, dict[str, Any]]] = {}

    async def call(self, op: str, **fields: Any) -> tuple[int, dict[str, Any]]:
        key = fields.get("idempotency_key")
        if key in self.seen:
            self.calls.append((op, fields))
            status, body = self.seen[key]
            return status, {**body, routes.REPLAYED_FIELD: True}
        status, body = await super().call(op, **fields)
        if key:
            self.seen[key] = (status, body)
        return status, body


def test_idempotency_key_from_header_or_body_reaches_every_rank_and_a_replay_says_so(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    ranks = [_KeyedRank({None: {"t1"}}), _KeyedRank({None: set()})]
    monkeypatch.setattr(routes._State, "clients", ranks)
    monkeypatch.setattr(routes._State, "client", ranks[0])
    r = client.delete(f"{BASE}/t1", headers={"Idempotency-Key": "d1"})
    assert r.status_code == 200 and "idempotent-replayed" not in r.headers
    first = r.json()
    assert all(
        c.calls[-1] == ("end", {"trajectory_id": "t1", "idempotency_key": "d1"}) for c in ranks
    )
    r = client.delete(f"{BASE}/t1", headers={"Idempotency-Key": "d1"})
    assert r.status_code == 200 and r.json() == first  # not 404: the first answer again
    assert r.headers["idempotent-replayed"] == "true"
    assert client.delete(f"{BASE}/t1").status_code == 404
    # The body field (routers drop unknown headers) is the same key.
    r = client.post(f"{BASE}/t1/pause", json={"tool": "x", "idempotency_key": "p1"})
    assert ranks[0].calls[-1] == ("pause", {**ranks[0].calls[-1][1], "idempotency_key": "p1"})
    assert "idempotency_key" in ranks[1].calls[-1][1]


@pytest.mark.parametrize(
    ("headers", "body", "named"),
    [
        ({"Idempotency-Key": "a b"}, {"tool": "x"}, "header.idempotency-key"),
        ({}, {"tool": "x", "idempotency_key": ""}, "idempotency_key"),
        ({"Idempotency-Key": "a"}, {"tool": "x", "idempotency_key": "b"}, "idempotency_key"),
    ],
)
def test_a_bad_or_conflicting_idempotency_key_is_422(
    client: TestClient, headers: dict[str, str], body: dict[str, Any], named: str
) -> None:
    r = client.post(f"{BASE}/t1/pause", json=body, headers=headers)
    assert r.status_code == 422, r.text
    assert r.json()["detail"].startswith(f"invalid {named}")


async def test_auto_pause_reaches_every_dp_rank_in_the_tenant_namespace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 25 item 5: the hooks' auto-pause went to DP rank 0 only; a trajectory served by
    rank 1 was never paused. Every rank gets it, with the request's cache_salt."""
    ranks = [_FakeRank({"s": set()}), _FakeRank({"s": {"t1"}})]
    monkeypatch.setattr(routes._State, "hooks_clients", ranks)
    monkeypatch.setattr(routes._State, "engine_client", None)
    await routes._auto_pause("t1", "main", ["grep"], None, cache_salt="s")
    for rank in ranks:
        op, fields = rank.calls[-1]
        assert op == "pause" and fields["trajectory_id"] == "t1" and fields["cache_salt"] == "s"
    with pytest.raises(RuntimeError, match="404"):  # no rank holds it: the hook counts a failure
        await routes._auto_pause("t2", "main", ["grep"], None, cache_salt="s")


class _BusyEngine:
    """An engine client whose utility calls are answered only when the test says (vLLM answers
    them between engine steps, so a busy engine takes up to a step)."""

    def __init__(self) -> None:
        self.calls = 0
        self.step_done = asyncio.Event()

    async def is_sleeping(self) -> bool:
        self.calls += 1
        await self.step_done.wait()
        return False


@pytest.mark.parametrize("op", ["pause", "resume", "get"])
async def test_a_trajectory_op_answers_without_waiting_for_the_engine_step(
    monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    """The agent waits on pause and resume: the route wakes the engine (a utility call) but
    answers as soon as the manager has, not after the engine's current step."""
    rank = _FakeRank({None: {"t1"}})
    engine = _BusyEngine()
    monkeypatch.setattr(routes._State, "client", rank)
    monkeypatch.setattr(routes._State, "clients", [rank])
    monkeypatch.setattr(routes._State, "engine_client", engine)
    fields: dict[str, Any] = {"tool": "grep"} if op == "pause" else {}
    response = await asyncio.wait_for(
        routes._call(op, nudge=True, trajectory_id="t1", **fields), timeout=5
    )
    assert response.status_code == 200
    await asyncio.sleep(0)  # let the nudge task start: it is fired, just not awaited
    assert engine.calls == 1 and routes._State.background
    engine.step_done.set()
    await asyncio.gather(*routes._State.background)
    assert not routes._State.background


# --- tenants in the bodies and the status views (issue 40 items 5 and 7) ---------------------


@pytest.mark.parametrize("op", ["pause", "resume", "end"])
def test_a_body_cache_salt_names_the_tenant_as_the_header_does(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    """Item 7: behind vllm-router the header is dropped; the body forbade ``cache_salt``, so a
    salted trajectory could not be paused, resumed or deleted in the fleet."""
    rank = _FakeRank({"s": {"t1"}})
    monkeypatch.setattr(routes._State, "clients", [rank])
    monkeypatch.setattr(routes._State, "client", rank)
    body: dict[str, Any] = {"tool": "pytest"} if op == "pause" else {}
    path = f"{BASE}/t1" if op == "end" else f"{BASE}/t1/{op}"
    r = client.request(
        "DELETE" if op == "end" else "POST",
        path,
        json={**body, "cache_salt": "s", "model": "m", "agent_hint": {"session_id": "t1"}},
    )
    assert r.status_code == 200, r.text
    assert rank.calls[-1][1]["cache_salt"] == "s" and "model" not in rank.calls[-1][1]


@pytest.mark.parametrize("how", ["body", "query"])
def test_get_takes_the_tenant_from_its_body_or_query(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    rank = _FakeRank({"s": {"t1"}})
    monkeypatch.setattr(routes._State, "clients", [rank])
    monkeypatch.setattr(routes._State, "client", rank)
    if how == "body":
        r = client.request("GET", f"{BASE}/t1", json={"cache_salt": "s", "model": "m"})
    else:
        r = client.get(f"{BASE}/t1", params={"cache_salt": "s"})
    assert r.status_code == 200, r.text
    assert rank.calls[-1] == ("get", {"trajectory_id": "t1", "cache_salt": "s"})
    assert client.get(f"{BASE}/t1").status_code == 404  # the unsalted namespace


@pytest.mark.parametrize("op", ["pause", "resume", "end", "get", "status"])
def test_a_tenant_that_differs_between_header_and_body_is_400(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    rank = _FakeRank({"a": {"t1"}, "b": {"t1"}})
    calls: list[dict[str, Any]] = []
    plain = rank.call

    async def call(op: str, **fields: Any) -> tuple[int, dict[str, Any]]:
        calls.append(fields)
        return await plain(op, **fields)

    monkeypatch.setattr(rank, "call", call)
    monkeypatch.setattr(routes._State, "clients", [rank])
    monkeypatch.setattr(routes._State, "client", rank)
    body: dict[str, Any] = {"cache_salt": "b", **({"tool": "x"} if op == "pause" else {})}
    method, path = {
        "pause": ("POST", f"{BASE}/t1/pause"),
        "resume": ("POST", f"{BASE}/t1/resume"),
        "end": ("DELETE", f"{BASE}/t1"),
        "get": ("GET", f"{BASE}/t1"),
        "status": ("GET", "/agentkv/v1/status"),
    }[op]
    r = client.request(method, path, json=body, headers={routes.TENANT_HEADER: "a"})
    assert r.status_code == 400 and "tenant differs" in r.json()["detail"], r.text
    assert calls == []  # nothing reached the engine
    # The same salt twice is one tenant.
    r = client.request(
        method, path, json={**body, "cache_salt": "a"}, headers={routes.TENANT_HEADER: "a"}
    )
    assert r.status_code != 400 and calls[-1]["cache_salt"] == "a", r.text


class _StatusRank:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    async def call(self, op: str, **fields: Any) -> tuple[int, dict[str, Any]]:
        self.calls.append({"op": op, **fields})
        return 200, {"trajectory_ids": []}


def test_status_names_the_tenant_and_the_operator_view_needs_its_own_key(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 5: any API-key holder got the cross-tenant view."""
    rank = _StatusRank()
    monkeypatch.setattr(routes._State, "client", rank)
    monkeypatch.setattr(routes._State, "clients", [rank])
    monkeypatch.setattr(routes._State, "operator_key", "op-key")
    assert client.get("/agentkv/v1/status", headers={routes.TENANT_HEADER: "s"}).status_code == 200
    assert rank.calls[-1] == {"op": "status", "operator": False, "cache_salt": "s"}
    assert client.get("/agentkv/v1/status").status_code == 200
    assert rank.calls[-1] == {"op": "status", "operator": False}
    wrong = {routes.OPERATOR_HEADER: "guess"}
    assert client.get("/agentkv/v1/status", headers=wrong).status_code == 403
    right = {routes.OPERATOR_HEADER: "op-key"}
    assert client.get("/agentkv/v1/status", headers=right).status_code == 200
    assert rank.calls[-1] == {"op": "status", "operator": True}
    # A server without an operator key has no operator view at all.
    monkeypatch.setattr(routes._State, "operator_key", None)
    assert client.get("/agentkv/v1/status", headers=right).status_code == 403
    assert len(rank.calls) == 3


def test_the_operator_key_comes_from_the_setting_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agentkv_vllm.settings import OPERATOR_KEY_ENV, ConnectorSettings

    monkeypatch.delenv(OPERATOR_KEY_ENV, raising=False)
    assert ConnectorSettings().operator_key() is None
    monkeypatch.setenv(OPERATOR_KEY_ENV, "from-env")
    assert ConnectorSettings().operator_key() == "from-env"
    settings = ConnectorSettings.model_validate({"operator_api_key": "op-s3cret"})
    assert settings.operator_key() == "op-s3cret" and "op-s3cret" not in repr(settings)
