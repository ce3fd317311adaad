"""Plugin part 2: the pause/resume routes, decisions, leases, branches and their errors."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import NUM_BLOCKS, Server, full_blocks, lcp, long_text, wait_until

pytestmark = pytest.mark.e2e

LEASE_CAP_S = 2.0  # the lease a test about a lease's end asks for (the server's is long)


def _ctx(seed: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": long_text(seed, 400)}, {"role": "user", "content": "go"}]


def test_short_wait_retains_and_resume_hits_device(server: Server) -> None:
    """A retained trajectory survives traffic that evicts the same context served vanilla."""
    server.clean(tiers=False)  # the eviction arithmetic below assumes nothing else is pinned
    tid = "retain"
    msgs, vanilla = _ctx(2000), _ctx(2001)  # same length, other tokens
    server.chat(vanilla, salt="retain-vanilla")
    server.chat(msgs, trajectory=tid)
    out = server.pause(tid, "retain-grep", 0.0005)
    assert out["decision"]["action"] == "retain"
    assert out["decision"]["lease_s"] > 0
    branch = server.trajectory(tid)["branches"]["main"]
    assert branch["state"] == "retained"
    assert branch["pinned_blocks"] == branch["blocks"] > 0
    # Other traffic cycles every unpinned block of the pool once (vLLM evicts least recently
    # used first), staying far below the high-water mark: no pressure demotion.
    free_blocks = NUM_BLOCKS - 1 - branch["pinned_blocks"]
    noise_blocks, seed = 0, 2050
    while noise_blocks <= free_blocks:
        # ~1.3k tokens, ~10 blocks: short prompts prefill faster per token on this CPU
        noise = [{"role": "user", "content": long_text(seed, 260)}]
        noise_blocks += len(server.tokenize(noise)) // 128
        server.chat(noise, salt="retain-noise", max_tokens=1)
        seed += 1
    after_noise = server.trajectory(tid)["branches"]["main"]
    assert after_noise["state"] == "retained", json.dumps([after_noise, server.counters()])
    resumed = [*msgs, {"role": "user", "content": "result: ok"}]
    expected = full_blocks(lcp(server.tokenize(msgs), server.tokenize(resumed)))
    assert expected >= full_blocks(len(server.tokenize(msgs))) - 128
    got = server.chat(resumed, trajectory=tid)
    stats = got["kv_transfer_params"]["agentkv"]
    assert stats["device_hit_tokens"] == expected and stats["tier_hit_tokens"] == 0, stats
    # Vanilla vLLM lost the same context to that traffic.
    v = server.chat([*vanilla, {"role": "user", "content": "result: ok"}], salt="retain-vanilla")
    assert v["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    server.end(tid)


def test_lease_expiry_demotes(server: Server) -> None:
    server.clean(tiers=False)  # no other lease may run out meanwhile
    tid = "lease"
    server.chat(_ctx(2100), trajectory=tid)
    before = server.counters().get("lease_expired_demotions", 0)
    out = server.pause(tid, "lease-ls", 0.0005, max_lease_s=LEASE_CAP_S)
    assert out["decision"]["action"] == "retain"
    assert out["decision"]["lease_s"] == LEASE_CAP_S  # the caller's cap bounds the lease
    time.sleep(out["decision"]["lease_s"] + 0.5)  # wall-clock: the lease runs out
    branch = server.wait_state(tid, {"offloading", "offloaded"})
    assert branch["tier"] == "host" and branch["demoted_by"] == "lease_expired"
    assert server.counters().get("lease_expired_demotions", 0) - before == 1
    server.end(tid)


def test_long_and_human_waits_offload_to_host_and_disk(server: Server) -> None:
    for tid, tool, wait, tier in (
        ("long", "long-pytest", 2.0, "host"),
        ("human", "human-approval", 7200.0, "disk"),
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
    server.pause(tid, "compile-learn", 2.0)
    time.sleep(0.3)  # wall-clock: the tool "runs" 0.3 s
    r = server.client.post(f"/agentkv/v1/trajectories/{tid}/resume", json={})
    assert r.status_code == 200 and 0.2 < r.json()["observed_wait_s"] < 30
    assert server.status()["predictor"].get("compile-learn") == 1
    server.end(tid)


def test_branches_share_prefix_and_end_frees_everything(server: Server) -> None:
    tid = "forked"
    base = _ctx(2400)
    try_a = [*base, {"role": "user", "content": "try A"}]
    try_b = [*base, {"role": "user", "content": "try B: " + long_text(2401, 150)}]
    b_more = [*try_b, {"role": "user", "content": "more"}]
    server.chat(base, trajectory=tid)
    a = server.chat(try_a, trajectory=tid, branch="a")
    # Branch a hits every full block it shares with main's context.
    shared = full_blocks(lcp(server.tokenize(base), server.tokenize(try_a)))
    assert shared > 0
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
    server.chat(try_b, trajectory=tid, branch="b")
    server.pause(tid, "forked-pytest", 2.0, branch="a")
    server.wait_state(tid, {"offloaded"}, branch="a")
    # Pausing branch a freed nothing branch b relies on: b's next turn hits all of b's context
    # (the shared head included), as vanilla vLLM would.
    b2 = server.chat(b_more, trajectory=tid, branch="b")
    b_context = full_blocks(lcp(server.tokenize(try_b), server.tokenize(b_more)))
    assert b_context > shared
    assert b2["usage"]["prompt_tokens_details"]["cached_tokens"] == b_context
    assert b2["kv_transfer_params"]["agentkv"]["device_hit_tokens"] == b_context
    r = server.client.delete(f"/agentkv/v1/trajectories/{tid}")
    assert r.status_code == 200
    assert server.client.get(f"/agentkv/v1/trajectories/{tid}").status_code == 404


def test_pool_pressure_demotes_the_farthest_return_only(server: Server) -> None:
    """Three retained trajectories hold ~75% of the pool; a long vanilla request pushes use past
    the high-water mark (0.88): exactly one is demoted, the one predicted back last."""
    server.clean(tiers=False)  # the pool arithmetic below assumes nothing else is pinned
    tids = ["press-a", "press-b", "press-c"]
    returns: dict[str, float] = {}  # predicted return: pause time + predicted median wait
    for i, tid in enumerate(tids):
        server.chat(
            [{"role": "user", "content": long_text(2600 + i, 1040)}], trajectory=tid, max_tokens=1
        )
        paused = time.monotonic()
        out = server.pause(tid, f"quick-{i}", 0.0001 * (i + 1))
        assert out["decision"]["action"] == "retain", out
        returns[tid] = paused + out["wait_estimate"]["p50"]
    before = server.status()
    assert all(server.trajectory(t)["branches"]["main"]["state"] == "retained" for t in tids)
    assert before["pool"]["pinned_blocks"] >= 3 * 40
    # ~40 blocks of prompt: 144 + 40 of 191 blocks is above 0.88, 96 + 40 is below.
    server.chat([{"role": "user", "content": long_text(2650, 830)}], salt="press-noise")

    def settled() -> dict[str, dict[str, Any]] | None:
        b = {t: server.trajectory(t)["branches"]["main"] for t in tids}
        return None if any(x["state"] == "offloading" for x in b.values()) else b

    branches = wait_until(settled, "the pressure demotion's offload to finish")
    farthest = max(returns, key=lambda t: returns[t])
    assert branches[farthest]["state"] == "offloaded", branches
    assert branches[farthest]["demoted_by"] == "pressure"
    # One spike, one demotion: the others are still retained, pinned, undemoted.
    for t in tids:
        if t != farthest:
            assert branches[t]["state"] == "retained", branches[t]
            assert branches[t]["demoted_by"] is None and branches[t]["pinned_blocks"] > 0
    after = server.counters().get("pressure_demotions", 0)
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


# --- tenants (issue 40 items 5 and 7) ---------------------------------------------------------

SALT = "X-AgentKV-Cache-Salt"


def test_status_shows_a_tenant_nothing_of_another(server: Server) -> None:
    """Item 5: /status listed every tenant's trajectory ids and the tools learned from all of
    them to any API-key holder; the cross-tenant view needs the operator key."""
    uid = f"{time.monotonic_ns():x}"
    tid, tool = f"b-secret-{uid}", f"b-secret-tool-{uid}"
    b = {SALT: f"tenant-b-{uid}"}
    try:
        server.chat(_ctx(2400), trajectory=tid, salt=b[SALT])
        r = server.client.post(
            f"/agentkv/v1/trajectories/{tid}/pause",
            json={"tool": tool, "expected_wait_s": 1.0},
            headers=b,
        )
        assert r.status_code == 200, r.text
        r = server.client.post(f"/agentkv/v1/trajectories/{tid}/resume", json={}, headers=b)
        assert r.status_code == 200, r.text
        for tenant in ({SALT: f"tenant-a-{uid}"}, {}):
            r = server.client.get("/agentkv/v1/status", headers=tenant)
            assert r.status_code == 200
            assert tid not in r.text and tool not in r.text, r.text
            assert r.json()["view"] == "tenant" and r.json()["trajectories"] >= 1  # counts stay
        operator = server.status()  # the operator key (conftest): every tenant
        assert operator["view"] == "operator" and tid in operator["trajectory_ids"]
        assert operator["predictor"].get(tool) == 1
        own = server.client.get("/agentkv/v1/status", headers=b).json()
        assert own["trajectory_ids"] == [tid] and tool not in json.dumps(own)
        wrong = {"X-AgentKV-Operator-Key": "guess"}
        assert server.client.get("/agentkv/v1/status", headers=wrong).status_code == 403
    finally:
        server.client.delete(f"/agentkv/v1/trajectories/{tid}", headers=b)


def test_a_pause_with_cache_salt_in_the_body_and_no_header_works(server: Server) -> None:
    """Item 7: behind vllm-router the header is dropped and the bodies forbade cache_salt: a
    salted trajectory could not be paused, read or deleted in a fleet."""
    uid = f"{time.monotonic_ns():x}"
    tid, salt = f"body-salt-{uid}", f"tenant-body-{uid}"
    server.chat(_ctx(2500), trajectory=tid, salt=salt)
    base = f"/agentkv/v1/trajectories/{tid}"
    r = server.client.post(
        f"{base}/pause",
        json={"tool": f"body-tool-{uid}", "expected_wait_s": 1.0, "cache_salt": salt},
    )
    assert r.status_code == 200 and r.json()["trajectory_id"] == tid, r.text

    def paused() -> bool:
        r = server.client.get(base, params={"cache_salt": salt})
        assert r.status_code == 200, r.text
        return bool(r.json()["branches"]["main"]["state"] != "active")

    wait_until(paused, "the body-salted pause to apply")
    assert server.client.get(base).status_code == 404  # the unsalted namespace has no such id
    r = server.client.request(
        "DELETE", base, json={"cache_salt": salt}, headers={SALT: f"other-{uid}"}
    )
    assert r.status_code == 400  # header and body name two tenants
    r = server.client.request("DELETE", base, json={"cache_salt": salt})
    assert r.status_code == 200 and r.json()["trajectory_id"] == tid, r.text
    assert server.client.get(base, params={"cache_salt": salt}).status_code == 404
