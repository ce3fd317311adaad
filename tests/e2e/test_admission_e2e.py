"""Issue 26 on a tiny pool (40 blocks of 128 tokens), the production write-back rule:
pins are a loan the queue calls in (a waiting request is admitted within one step of the
retained trajectory's demotion), a roomy pause copies nothing (nor a turn nobody paused), a preempted trajectory request is
saved to host and its reschedule loads it instead of recomputing."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Server, long_text, start_server, wait_until

pytestmark = pytest.mark.e2e

TINY_BLOCKS = 40  # 5,120 tokens of device KV; one block is vLLM's null block
BLOCK = 128


@pytest.fixture(scope="module")
def tiny() -> Iterator[Server]:
    work = Path(tempfile.mkdtemp(prefix="agentkv-admission-e2e-"))
    connector = {
        "host_capacity_gib": 0.25,
        "grace_s": 0.3,
        # A retained lease outlives the test's own steps (the queue, not the lease, ends it).
        "lease_margin_s": 120,
        "job_timeout_s": 20,
    }
    args = ("--num-gpu-blocks-override", str(TINY_BLOCKS), "--max-model-len", "4096")
    with start_server(work, connector, vllm_args=args) as srv:
        yield srv


def _messages(server: Server, seed: int, blocks: int) -> list[dict[str, Any]]:
    """A user message of about ``blocks`` full blocks of prompt (sized with /tokenize)."""
    words = blocks * 20
    for _ in range(8):
        msgs = [{"role": "user", "content": long_text(seed, words)}]
        n = len(server.tokenize(msgs))
        if abs(n - blocks * BLOCK) < BLOCK // 2:
            return msgs
        words = max(1, int(words * blocks * BLOCK / n))
    return msgs


def test_a_waiting_request_is_admitted_within_one_step_of_the_demotion(tiny: Server) -> None:
    tiny.clean()
    held = _messages(tiny, 3000, 16)
    tiny.chat(held, trajectory="loan", max_tokens=1)
    out = tiny.pause("loan", "loan-grep", 0.0005)
    assert out["decision"]["action"] == "retain", out
    pinned = tiny.trajectory("loan")["branches"]["main"]["pinned_blocks"]
    assert pinned >= 15
    before = tiny.status()
    # A plain request needing more blocks than the pool has free while the branch is pinned.
    plain = _messages(tiny, 3001, 26)
    assert 26 + pinned > TINY_BLOCKS - 1
    got = tiny.chat(plain, max_tokens=2)
    assert got["usage"]["completion_tokens"] == 2
    after = tiny.status()
    assert after["counters"]["queue_demotions"] - before["counters"]["queue_demotions"] == 1
    pool = after["pool"]
    unblocked = pool["last_unblocked"]
    assert unblocked is not None and pool["last_queue_demotion_step"] is not None, pool
    assert unblocked["blocked_at_step"] <= pool["last_queue_demotion_step"], pool
    assert unblocked["admitted_at_step"] - pool["last_queue_demotion_step"] <= 1, pool
    branch = tiny.wait_state("loan", {"offloaded"})
    assert branch["demoted_by"] == "queue_blocked" and branch["tier"] == "host", branch
    # The demoted trajectory resumes from its host copy.
    resumed = tiny.chat([*held, {"role": "user", "content": "ok"}], trajectory="loan")
    stats = resumed["kv_transfer_params"]["agentkv"]
    assert stats["device_hit_tokens"] + stats["tier_hit_tokens"] >= (pinned - 1) * BLOCK, stats
    tiny.end("loan")


def test_a_roomy_pause_unpins_without_a_copy_and_resumes_from_the_device(tiny: Server) -> None:
    tiny.clean()
    msgs = _messages(tiny, 3100, 8)
    tiny.chat(msgs, trajectory="roomy", max_tokens=32)  # decode steps: the fill rate settles
    stores = tiny.counters()["stores"]
    out = tiny.pause("roomy", "roomy-build", 0.5)
    decision = out["decision"]
    assert decision["action"] == "offload_host", decision
    assert decision["writeback_deferred"] is True, decision
    assert "host copy deferred" in decision["rationale"]
    branch = tiny.wait_state("roomy", {"cached"})
    assert branch["pinned_blocks"] == 0
    resumed = tiny.chat([*msgs, {"role": "user", "content": "result: ok"}], trajectory="roomy")
    stats = resumed["kv_transfer_params"]["agentkv"]
    assert stats["device_hit_tokens"] >= 7 * BLOCK and stats["tier_hit_tokens"] == 0, stats
    counters = tiny.counters()
    assert counters["stores"] == stores  # no copy was made
    assert counters["writebacks_deferred"] >= 1
    tiny.end("roomy")
    assert tiny.counters()["writebacks_unread"] == counters["writebacks_unread"]


def test_a_plain_prefix_cache_reset_copies_a_deferred_context_and_the_turn_loads_it(
    tiny: Server,
) -> None:
    """Issue 42: a roomy pause defers its host copy (``cached``: the blocks only in vLLM's prefix
    cache); a plain ``POST /reset_prefix_cache`` dropped them while the branch still said
    ``cached`` and nothing counted the loss, so the next turn recomputed. Now the reset makes the
    deferred copy from the blocks it unhashed, and the next turn loads it from host."""
    tiny.clean()
    msgs = _messages(tiny, 3150, 8)
    tiny.chat(msgs, trajectory="flushed", max_tokens=32)
    out = tiny.pause("flushed", "flush-build", 0.5)
    assert out["decision"]["writeback_deferred"] is True, out
    tiny.wait_state("flushed", {"cached"})
    before = tiny.counters()
    tiny.reset_prefix_cache()
    branch = tiny.wait_state("flushed", {"offloaded"})
    assert branch["tier"] == "host" and branch["pinned_blocks"] == 0, branch
    after = tiny.counters()
    assert after["writebacks_reset_copied"] - before["writebacks_reset_copied"] == 1, after
    assert after["writebacks_deferred_lost_blocks"] == before["writebacks_deferred_lost_blocks"]
    resumed = tiny.chat([*msgs, {"role": "user", "content": "result: ok"}], trajectory="flushed")
    stats = resumed["kv_transfer_params"]["agentkv"]
    assert stats["device_hit_tokens"] == 0 and stats["tier_hit_tokens"] >= 7 * BLOCK, stats
    tiny.end("flushed")


def _complete(server: Server, ids: list[int], tid: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": server.model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "kv_transfer_params": {"agentkv": {"trajectory_id": tid}},
    }
    r = server.client.post("/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return dict(r.json())


def test_a_preempted_trajectory_request_is_saved_and_resumes_without_recompute(
    tiny: Server,
) -> None:
    tiny.clean()
    tiny.reset_prefix_cache()
    before = tiny.counters()
    # Two trajectory requests of 19 blocks less 4 tokens each fill 38 of the 39 usable blocks;
    # a few decode tokens later both need a 20th block, one gets the last free one and vLLM
    # preempts the other. 48 tokens each (still 20 blocks): the first is still decoding when
    # the second's prefill lands even if its HTTP request comes late (with 12 the first could
    # finish before the second was admitted: no preemption, once in nine runs).
    vocab = tiny.tokenize([{"role": "user", "content": long_text(3200, 3000)}], gen=False)
    length = 19 * BLOCK - 4
    prompts = [vocab[i * 7 : i * 7 + length] for i in range(2)]
    assert all(len(p) == length for p in prompts)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(_complete, tiny, p, f"swap-{i}", 48) for i, p in enumerate(prompts)]
        outs = [f.result() for f in futures]
    assert all(o["usage"]["completion_tokens"] == 48 for o in outs)
    after = tiny.counters()
    assert after["preempt_saves"] - before["preempt_saves"] >= 1, after
    saved = after["preempt_saved_tokens"] - before["preempt_saved_tokens"]
    assert saved >= 18 * BLOCK, after  # every full computed block of the preempted request
    # The rescheduled request recomputed none of its saved blocks: each came back from vLLM's
    # own cache (still there: nothing reused it meanwhile) or from the host copy.
    trajs = [tiny.trajectory(f"swap-{i}")["turns"][-1] for i in range(2)]
    assert max(t["device_hit_tokens"] + t["tier_hit_tokens"] for t in trajs) >= 18 * BLOCK, trajs
    wait_until(lambda: tiny.status()["tiers"]["in_flight_jobs"] == 0 or None, "jobs to drain")
    for i in range(2):
        tiny.end(f"swap-{i}")


def test_a_turn_nobody_pauses_stays_in_vllms_cache_after_its_grace(tiny: Server) -> None:
    """No pause within the grace (a final answer; a harness that never pauses): the default
    offload_host waits for the eviction forecast like a deferred pause, so a roomy pool makes
    no copy and the next turn hits the device."""
    tiny.clean()
    msgs = _messages(tiny, 3200, 8)
    before = tiny.counters()
    tiny.chat(msgs, trajectory="unpaused", max_tokens=32)
    branch = tiny.wait_state("unpaused", {"cached"})  # grace 0.3 s, then the default action
    assert branch["demoted_by"] == "grace_expired" and branch["pinned_blocks"] == 0, branch
    resumed = tiny.chat([*msgs, {"role": "user", "content": "thanks"}], trajectory="unpaused")
    stats = resumed["kv_transfer_params"]["agentkv"]
    assert stats["device_hit_tokens"] >= 7 * BLOCK and stats["tier_hit_tokens"] == 0, stats
    after = tiny.counters()
    assert after["stores"] == before["stores"]  # no copy was made
    assert after["grace_expired"] - before["grace_expired"] == 1
    assert after["writebacks_deferred"] - before["writebacks_deferred"] == 1
    tiny.end("unpaused")


def _plain(server: Server, ids: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": server.model, "prompt": ids, "max_tokens": max_tokens, "ignore_eos": True}
    r = server.client.post("/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return dict(r.json())


def test_pause_keep_clearing_caches_succeeds_while_a_planned_load_waits(tiny: Server) -> None:
    """Issue 40 item 4, the RL weight-sync path: a trajectory's turn whose lookup planned a host
    load waits for blocks a plain request holds (vLLM could not allocate for it: nothing was
    copied), and vLLM is paused with ``mode=keep`` and its caches cleared. Paused, vLLM never
    looks the turn up again; counting its plan as a stale load made ``reset_cache()`` False, and
    the pause failed ("Failed to reset the KV connector cache."). It succeeds, and after the
    resume the turn loads nothing computed before the reset."""
    tiny.clean()
    tiny.reset_prefix_cache()
    vocab = tiny.tokenize([{"role": "user", "content": long_text(3300, 4500)}], gen=False)
    ctx = vocab[: 18 * BLOCK - 4]  # 17 full blocks
    hog = vocab[18 * BLOCK : 38 * BLOCK]  # 20 blocks, then decodes for seconds
    assert len(hog) == 20 * BLOCK
    _complete(tiny, ctx, "paused-reset", 1)
    decision = tiny.pause("paused-reset", "reset-tool", None)["decision"]  # unknown: copy now
    assert decision["action"] == "offload_host", decision
    tiny.wait_state("paused-reset", {"offloaded"})
    tiny.reset_prefix_cache()  # only the host tier has the context now
    turn2 = [*ctx, *vocab[40 * BLOCK : 42 * BLOCK]]  # 20 blocks: more than the hog leaves free
    generation = tiny.status()["engine"]["kv_generation"]
    with ThreadPoolExecutor(2) as pool:
        hog_f = pool.submit(_plain, tiny, hog, 1000)
        wait_until(lambda: tiny.status()["engine"]["live_requests"] == 1, "the plain request")
        turn_f = pool.submit(_complete, tiny, turn2, "paused-reset", 1)

        def planned_and_blocked() -> bool:
            s = tiny.status()
            return s["engine"]["live_requests"] == 2 and s["pool"]["admission"]["waiting"] >= 1

        wait_until(planned_and_blocked, "the turn looked up and blocked on blocks")
        assert not hog_f.done() and not turn_f.done()  # the turn's plan is still pending
        try:
            r = tiny.client.post("/pause", params={"mode": "keep", "clear_cache": "true"})
            assert r.status_code == 200, r.text
        finally:
            tiny.client.post("/resume")
        turn = turn_f.result(timeout=300)
        hog_f.result(timeout=300)
    assert tiny.status()["engine"]["kv_generation"] != generation
    assert turn["usage"]["completion_tokens"] == 1
    stats = turn["kv_transfer_params"]["agentkv"]
    assert stats["tier_hit_tokens"] == 0, stats  # nothing of the old generation loaded
    assert tiny.trajectory_code("paused-reset") == 404  # the reset ended it


def _waiting_in_vllm(server: Server) -> float:
    """vLLM's own count of requests in its waiting queue (its scheduler's, each step)."""
    total = 0.0
    for line in server.metrics_text().splitlines():
        if line.startswith("vllm:num_requests_waiting"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_turn_queued_in_vllm_before_the_delete_does_not_bring_the_trajectory_back(
    tiny: Server,
) -> None:
    """Issue 40 item 9: a plain request at the head of vLLM's queue waits for blocks a long one
    holds, and a trajectory's turn waits behind it, never looked up, while the client DELETEs
    the trajectory (200). Scheduled later, that turn arrived before the DELETE (vLLM's
    ``arrival_time``): it runs as a vanilla request and the trajectory stays deleted. Before,
    it re-created it (pins, a host copy, kept until idle_ttl_s)."""
    tiny.clean()
    tiny.reset_prefix_cache()
    vocab = tiny.tokenize([{"role": "user", "content": long_text(3400, 4500)}], gen=False)
    turn1 = vocab[: 4 * BLOCK]
    hog = vocab[5 * BLOCK : 25 * BLOCK]  # 20 blocks, then decodes for seconds
    head = vocab[25 * BLOCK : 45 * BLOCK] if len(vocab) >= 45 * BLOCK else hog[::-1]
    _complete(tiny, turn1, "queued-delete", 1)
    assert tiny.trajectory_code("queued-delete") == 200
    with ThreadPoolExecutor(3) as pool:
        hog_f = pool.submit(_plain, tiny, hog, 1500)
        wait_until(lambda: tiny.status()["engine"]["live_requests"] == 1, "the long request")
        head_f = pool.submit(_plain, tiny, head, 1)  # 20 blocks: more than the hog leaves
        wait_until(lambda: tiny.status()["pool"]["admission"]["waiting"] >= 1, "a blocked head")
        turn_f = pool.submit(_complete, tiny, [*turn1, *vocab[: BLOCK // 2]], "queued-delete", 1)
        wait_until(lambda: _waiting_in_vllm(tiny) >= 2, "the turn queued behind the head")
        # Looked up: the long request and the blocked head; the turn behind them never was.
        assert tiny.status()["engine"]["live_requests"] == 2
        assert tiny.client.delete("/agentkv/v1/trajectories/queued-delete").status_code == 200
        assert not hog_f.done() and not turn_f.done()
        turn = turn_f.result(timeout=300)
        head_f.result(timeout=300)
        hog_f.result(timeout=300)
    assert not (turn.get("kv_transfer_params") or {}).get("agentkv"), turn  # a vanilla request
    assert tiny.trajectory_code("queued-delete") == 404
    assert tiny.status()["trajectories"] == 0
    # A turn sent after the DELETE starts a fresh trajectory.
    again = _complete(tiny, turn1, "queued-delete", 1)
    assert again["kv_transfer_params"]["agentkv"]["turn"] == 1, again
    tiny.end("queued-delete")
