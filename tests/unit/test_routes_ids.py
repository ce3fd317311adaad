"""The agentkv routes apply the id grammar of agentkv.ids to path ids and body branches: 422
naming the field, even under vLLM's exception handlers (which turn FastAPI validation into 400).

FastAPI TestClient in-process; no server, no engine (the control client is absent, so a valid id
gets the routes' 503 'connector is not enabled').
"""

from __future__ import annotations

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
