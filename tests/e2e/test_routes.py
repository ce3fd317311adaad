"""Plugin part 2: the pause/resume routes, decisions, leases, branches and their errors."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.conftest import Server, long_text

pytestmark = pytest.mark.e2e


def _ctx(seed: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": long_text(seed, 400)}, {"role": "user", "content": "go"}]


def test_short_wait_retains_and_resume_hits_device(server: Server) -> None:
    tid = "retain"
    msgs = _ctx(2000)
    server.chat(msgs, trajectory=tid)
    out = server.pause(tid, "grep", 0.0005)
    assert out["decision"]["action"] == "retain"
    assert out["decision"]["lease_s"] > 0
    assert server.trajectory(tid)["branches"]["main"]["state"] == "retained"
    assert server.trajectory(tid)["branches"]["main"]["pinned_blocks"] > 0
    got = server.chat([*msgs, {"role": "user", "content": "result: ok"}], trajectory=tid)
    stats = got["kv_transfer_params"]["agentkv"]
    assert stats["device_hit_tokens"] > 0 and stats["tier_hit_tokens"] == 0
    server.end(tid)


def test_lease_expiry_demotes(server: Server) -> None:
    tid = "lease"
    server.chat(_ctx(2100), trajectory=tid)
    out = server.pause(tid, "ls", 0.0005)
    assert out["decision"]["action"] == "retain"
    time.sleep(out["decision"]["lease_s"] + 0.5)
    branch = server.wait_state(tid, {"offloading", "offloaded"})
    assert branch["tier"] == "host"
    assert server.status()["counters"].get("lease_expired_demotions", 0) >= 1
    server.end(tid)


def test_long_and_human_waits_offload_to_host_and_disk(server: Server) -> None:
    for tid, tool, wait, tier in (
        ("long", "pytest", 45.0, "host"),
        ("human", "approval", 7200.0, "disk"),
    ):
        server.chat(_ctx(2200 + len(tid)), trajectory=tid)
        out = server.pause(tid, tool, wait)
        assert out["decision"]["action"] == f"offload_{tier}", out
        assert out["decision"]["rationale"]
        branch = server.wait_state(tid, {"offloaded"})
        assert branch["tier"] == tier
        server.end(tid)


def test_resume_teaches_the_predictor(server: Server) -> None:
    tid = "learn"
    server.chat(_ctx(2300), trajectory=tid)
    server.pause(tid, "compile-learn", 20.0)
    time.sleep(0.3)
    r = server.client.post(f"/agentkv/v1/trajectories/{tid}/resume", json={})
    assert r.status_code == 200 and 0.2 < r.json()["observed_wait_s"] < 30
    assert server.status()["predictor"].get("compile-learn") == 1
    server.end(tid)


def test_branches_share_prefix_and_end_frees_everything(server: Server) -> None:
    tid = "forked"
    base = _ctx(2400)
    server.chat(base, trajectory=tid)
    a = server.chat([*base, {"role": "user", "content": "try A"}], trajectory=tid, branch="a")
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # shares main's prefix
    server.chat([*base, {"role": "user", "content": "try B"}], trajectory=tid, branch="b")
    server.pause(tid, "pytest", 60.0, branch="a")
    server.wait_state(tid, {"offloaded"}, branch="a")
    # Pausing branch a freed nothing branch b relies on: b's next turn still hits.
    b2 = server.chat(
        [*base, {"role": "user", "content": "try B"}, {"role": "user", "content": "more"}],
        trajectory=tid,
        branch="b",
    )
    assert b2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    r = server.client.delete(f"/agentkv/v1/trajectories/{tid}")
    assert r.status_code == 200
    assert server.client.get(f"/agentkv/v1/trajectories/{tid}").status_code == 404


def test_pool_pressure_demotes_the_farthest_return_only(server: Server) -> None:
    """Three retained trajectories hold ~75% of the pool; a long vanilla request pushes use past
    the high-water mark (0.88): exactly one is demoted, the one predicted back last."""
    tids = ["press-a", "press-b", "press-c"]
    for i, tid in enumerate(tids):
        server.chat(
            [{"role": "user", "content": long_text(2600 + i, 1040)}], trajectory=tid, max_tokens=1
        )
        assert server.pause(tid, f"quick-{i}", 0.0001 * (i + 1))["decision"]["action"] == "retain"
    before = server.status()
    returns = {
        tid: server.trajectory(tid)["branches"]["main"]["predicted_return_at"] for tid in tids
    }
    assert all(server.trajectory(t)["branches"]["main"]["state"] == "retained" for t in tids)
    assert before["pool"]["pinned_blocks"] >= 3 * 40
    # ~40 blocks of prompt: 144 + 40 of 191 blocks is above 0.88, 96 + 40 is below.
    server.chat([{"role": "user", "content": long_text(2650, 830)}], salt="press-noise")
    branches = {t: server.trajectory(t)["branches"]["main"] for t in tids}
    farthest = max(returns, key=lambda t: returns[t])
    assert branches[farthest]["state"] in ("offloading", "offloaded"), branches
    assert branches[farthest]["demoted_by"] == "pressure"
    # The others stay retained (on a machine slow enough for their lease to run out first they
    # are demoted by lease expiry instead, never by pressure).
    for t in tids:
        if t != farthest:
            assert branches[t]["state"] == "retained" or branches[t]["demoted_by"] == (
                "lease_expired"
            ), branches[t]
    after = server.status()["counters"].get("pressure_demotions", 0)
    assert after - before["counters"].get("pressure_demotions", 0) == 1
    for tid in tids:
        server.end(tid)


def test_delete_releases_every_tier(server: Server) -> None:
    for tid in server.status()["trajectory_ids"]:
        server.end(tid)
    deadline = time.monotonic() + 10
    while True:
        held = server.status()["bytes_held"]
        if all(v == 0 for v in held.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert held == {"device_pinned": 0, "host": 0, "disk": 0}
    assert server.status()["trajectories"] == 0


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"tool": ""},
        {"tool": "x", "expected_wait_s": -1},
        {"tool": "x", "bogus": 1},
        {"tool": "x", "expected_wait_s": "soon"},
    ],
)
def test_bad_pause_bodies_are_422(server: Server, body: dict[str, object]) -> None:
    server.chat(_ctx(2500), trajectory="bad-body")
    r = server.client.post("/agentkv/v1/trajectories/bad-body/pause", json=body)
    assert r.status_code == 422
    assert r.json()["detail"]


def test_unknown_trajectory_is_404(server: Server) -> None:
    assert server.client.get("/agentkv/v1/trajectories/nope").status_code == 404
    r = server.client.post("/agentkv/v1/trajectories/nope/pause", json={"tool": "x"})
    assert r.status_code == 404 and "nope" in r.json()["detail"]
    assert server.client.delete("/agentkv/v1/trajectories/nope").status_code == 404


def test_api_key_is_enforced(server: Server) -> None:
    assert httpx.get(server.base_url + "/agentkv/v1/status").status_code == 401
    bad = {"Authorization": "Bearer wrong"}
    assert httpx.get(server.base_url + "/agentkv/v1/status", headers=bad).status_code == 401
    assert (
        httpx.post(
            server.base_url + "/agentkv/v1/trajectories/x/pause", json={"tool": "t"}, headers=bad
        ).status_code
        == 401
    )


def test_routes_are_in_openapi(server: Server) -> None:
    paths = server.client.get("/openapi.json").json()["paths"]
    assert "/agentkv/v1/status" in paths
    assert "/agentkv/v1/trajectories/{trajectory_id}/pause" in paths
