"""Trust at the edges (issue 25), on the shared real server:

- two tenants (two ``cache_salt`` values, the ``X-AgentKV-Cache-Salt`` header on the routes)
  using the SAME trajectory id are isolated: tenant B's turn stats carry nothing of A's context
  (no ``first_divergence_token`` oracle), B's GET shows only B's turns, B's pause and DELETE
  never pin or drop A's copies, and A's next turn still loads its context from the tier;
- retried control calls are idempotent: a pause or DELETE retried with the same
  ``Idempotency-Key`` answers the first answer (``Idempotent-Replayed: true``) and is applied
  once (no second decision; a retried DELETE answers 200, not 404).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.conftest import Server, long_text

pytestmark = pytest.mark.e2e

TENANT = "x-agentkv-cache-salt"


def _as(salt: str | None) -> dict[str, str]:
    return {TENANT: salt} if salt else {}


def _get(server: Server, tid: str, salt: str | None) -> Any:
    return server.client.get(f"/agentkv/v1/trajectories/{tid}", headers=_as(salt))


def _pause(
    server: Server, tid: str, salt: str | None, tool: str, wait: float, **headers: str
) -> Any:
    return server.client.post(
        f"/agentkv/v1/trajectories/{tid}/pause",
        json={"tool": tool, "expected_wait_s": wait},
        headers={**_as(salt), **headers},
    )


def _wait_offloaded(server: Server, tid: str, salt: str | None) -> dict[str, Any]:
    from tests.e2e.conftest import wait_until

    def offloaded() -> dict[str, Any] | None:
        b = _get(server, tid, salt).json()["branches"]["main"]
        return b if b["state"] == "offloaded" and b["residency_blocks"].get("host") else None

    return wait_until(offloaded, f"{tid} ({salt}) offloaded to host", 30)


def test_two_tenants_with_the_same_trajectory_id_are_isolated(server: Server) -> None:
    server.clean()
    tid = "tenant-shared-id"
    try:
        _tenants_isolated(server, tid)
    finally:  # server.clean() deletes the unsalted namespace only
        for salt in ("tenant-a", "tenant-b"):
            server.client.delete(f"/agentkv/v1/trajectories/{tid}", headers=_as(salt))


def _tenants_isolated(server: Server, tid: str) -> None:
    system = {"role": "system", "content": "You are a coding agent. " + long_text(2501, 500)}
    a_first = [system, {"role": "user", "content": "Secret task of A: " + long_text(2502, 80)}]
    a_out = server.chat(a_first, trajectory=tid, salt="tenant-a")
    assert _pause(server, tid, "tenant-a", "edges-a-tool", 1.0).json()["decision"]["action"] == (
        "offload_host"
    )
    a_held = _wait_offloaded(server, tid, "tenant-a")["residency_blocks"]["host"]

    # B, another tenant, names the same id with a guess sharing A's system prompt: B's stats
    # are those of B's own first turn (on a shared namespace they carried the length of the
    # common prefix with A's context: A's prompt, a token per request).
    b_turn = [system, {"role": "user", "content": "Secret task of A: " + long_text(2502, 40)}]
    b_stats = server.chat(b_turn, trajectory=tid, salt="tenant-b")["kv_transfer_params"]["agentkv"]
    assert b_stats["first_divergence_token"] is None, b_stats
    assert b_stats["tier_hit_tokens"] == 0 and b_stats["device_hit_tokens"] == 0, b_stats
    b_view = _get(server, tid, "tenant-b").json()
    assert len(b_view["turns"]) == 1
    # The unsalted namespace (no header) holds no such trajectory: 404, nothing created.
    assert _get(server, tid, None).status_code == 404
    assert server.client.delete(f"/agentkv/v1/trajectories/{tid}").status_code == 404

    # B pauses (retain: pins B's blocks) and deletes its own trajectory; A stays untouched.
    assert _pause(server, tid, "tenant-b", "edges-b-tool", 0.0005).json()["decision"]["action"] == (
        "retain"
    )
    a_view = _get(server, tid, "tenant-a").json()
    assert a_view["branches"]["main"]["state"] == "offloaded"
    assert a_view["branches"]["main"]["residency_blocks"]["host"] == a_held
    assert len(a_view["turns"]) == 1
    r = server.client.delete(f"/agentkv/v1/trajectories/{tid}", headers=_as("tenant-b"))
    assert r.status_code == 200 and r.json()["released_blocks"] > 0, r.json()
    assert _get(server, tid, "tenant-b").status_code == 404
    a_view = _get(server, tid, "tenant-a").json()
    assert a_view["branches"]["main"]["residency_blocks"]["host"] == a_held

    # A's next turn, vLLM's own cache flushed, loads A's context from the host tier.
    server.reset_prefix_cache()
    a_second = [
        *a_first,
        {"role": "assistant", "content": a_out["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Observation: " + long_text(2503, 40)},
    ]
    a_stats = server.chat(a_second, trajectory=tid, salt="tenant-a")["kv_transfer_params"][
        "agentkv"
    ]
    assert a_stats["tier"] == "host" and a_stats["tier_hit_tokens"] > 0, a_stats
    assert len(_get(server, tid, "tenant-a").json()["turns"]) == 2  # A's turns only


def test_retried_pause_and_delete_with_the_same_key_are_applied_once(server: Server) -> None:
    tid = "idempotent-retry"
    server.chat(
        [{"role": "user", "content": "Run the tests. " + long_text(2601, 300)}], trajectory=tid
    )
    first = _pause(server, tid, None, "edges-idem-tool", 1.0, **{"Idempotency-Key": "pause-1"})
    assert first.status_code == 200 and "idempotent-replayed" not in first.headers
    decided = sum(server.status()["decisions"].values())
    retry = _pause(server, tid, None, "edges-idem-tool", 1.0, **{"Idempotency-Key": "pause-1"})
    assert retry.status_code == 200 and retry.headers["idempotent-replayed"] == "true"
    assert retry.json() == first.json()
    assert sum(server.status()["decisions"].values()) == decided  # not paused twice
    other = _pause(server, tid, None, "edges-idem-tool", 7.0, **{"Idempotency-Key": "pause-1"})
    assert other.status_code == 422, other.text  # the same key for another request
    _wait_offloaded(server, tid, None)

    path = f"/agentkv/v1/trajectories/{tid}"
    deleted = server.client.delete(path, headers={"Idempotency-Key": "delete-1"})
    assert deleted.status_code == 200 and deleted.json()["dropped_tier_blocks"] > 0
    again = server.client.delete(path, headers={"Idempotency-Key": "delete-1"})
    assert again.status_code == 200 and again.json() == deleted.json()  # not 404
    assert again.headers["idempotent-replayed"] == "true"
    assert server.client.delete(path).status_code == 404  # without a key: as before
    assert server.trajectory_code(tid) == 404
