"""The plugin's state machine end to end: aborts during tier loads, DELETE during a running
request, pauses that arrive after the grace period, and timers that fire on an idle server.

Fixture knobs these tests rely on (``conftest.server``): grace_s 0.3, disk_after_s 3 (declared
waits <= 2 s go to host, >= 5 s to disk), debug_load_delay_s 1 (every disk load waits 1 s in the
worker before it copies).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Server, full_blocks, lcp, long_text, tokens_and_logprobs, wait_until

pytestmark = pytest.mark.e2e


def _ctx(seed: int, words: int = 400) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You are a coding agent. " + long_text(seed, words)},
        {"role": "user", "content": "Fix the failing test."},
    ]


def _next(msgs: list[dict[str, str]], seed: int) -> list[dict[str, str]]:
    return [*msgs, {"role": "user", "content": "Observation: " + long_text(seed, 60)}]


def _branch(server: Server, tid: str, branch: str = "main") -> dict[str, Any]:
    return dict(server.trajectory(tid)["branches"][branch])


def _wait_branch(
    server: Server,
    tid: str,
    ok: Callable[[dict[str, Any]], bool],
    what: str,
    timeout: float = 20,
) -> dict[str, Any]:
    """Poll the branch until ``ok(branch)``; on timeout fail with the last view."""
    deadline = time.monotonic() + timeout
    while True:
        b = _branch(server, tid)
        if ok(b):
            return b
        if time.monotonic() > deadline:
            raise AssertionError(f"{tid}: timed out waiting for {what}; last view: {b}")
        time.sleep(0.1)


@contextlib.contextmanager
def _stream(server: Server, messages: list[dict[str, str]], **kw: Any) -> Iterator[httpx.Response]:
    """A streaming chat on its own connection; leaving the block closes that connection."""
    body = server.chat_body(messages, stream=True, **kw)
    with (
        httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        response.raise_for_status()
        yield response


def test_abort_during_disk_load_holds_nothing_and_retry_is_exact(server: Server) -> None:
    """The client goes away while the turn's KV is being loaded from disk: the request ends with
    its load unconfirmed (counted in aborted_loads), nothing of it is pinned or kept, and the
    same turn sent again gives exactly the tokens and logprobs of vLLM's own cache."""
    first = _ctx(4000)
    second = _next(first, 4001)
    tid = "abort-load"
    server.chat(first, trajectory=tid)
    assert server.pause(tid, "abort-approval", 3600.0)["decision"]["action"] == "offload_disk"
    branch = server.wait_state(tid, {"offloaded"})
    assert branch["tier"] == "disk"
    server.reset_prefix_cache()  # only the disk tier has the context now
    # Reference: the same two turns from vLLM's own prefix cache (salted: no tier involved).
    server.chat(first, salt="ref-abort")
    ref = server.chat(second, salt="ref-abort")
    ref_cached = ref["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert ref_cached == full_blocks(lcp(server.tokenize(first), server.tokenize(second))) > 0

    before = server.counters()
    pinned_before = server.status()["pool"]["pinned_blocks"]
    with _stream(server, second, trajectory=tid):
        # The engine has taken the request (the branch left "offloaded"); its disk load now waits
        # 1 s in the worker. Leaving the block closes the connection: vLLM aborts the request.
        _wait_branch(server, tid, lambda b: b["state"] != "offloaded", "the engine to take it")

    def aborted() -> int:
        return server.counters().get("aborted_loads", 0) - before.get("aborted_loads", 0)

    assert wait_until(aborted, "the aborted load to be counted", timeout=15) == 1
    view = server.trajectory(tid)
    assert view["branches"]["main"]["pinned_blocks"] == 0, view
    assert view.get("bytes_held", {}).get("device_pinned") == 0, view
    assert server.status()["pool"]["pinned_blocks"] == pinned_before

    got = server.chat(second, trajectory=tid)
    stats = got["kv_transfer_params"]["agentkv"]
    after = server.counters()
    changed = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    why = {"retry": stats, "after_abort": view["branches"]["main"], "counters": changed}
    # Never half-loaded blocks: the reply is the one vLLM's own cache gives.
    assert [t for t, _ in tokens_and_logprobs(got)] == [t for t, _ in tokens_and_logprobs(ref)]
    # And the abort cost nothing: the tier copy survived it and serves the retry, bit-identical.
    assert stats["device_hit_tokens"] + stats["tier_hit_tokens"] == ref_cached, why
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == ref_cached
    assert tokens_and_logprobs(got) == tokens_and_logprobs(ref)
    server.end(tid)


def test_delete_during_a_streaming_request(server: Server) -> None:
    """DELETE while a request of the trajectory runs: 404 from then on, the client still gets its
    whole reply, and once the request ended the server holds nothing of it."""
    server.clean()  # bytes_held below must be this trajectory's only
    tid = "delete-streaming"
    msgs = [{"role": "user", "content": long_text(4100, 200)}]
    with _stream(
        server, msgs, trajectory=tid, max_tokens=64, stream_options={"include_usage": True}
    ) as response:
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        first = next(lines)  # the request is running (prefill done, decoding)
        r = server.client.delete(f"/agentkv/v1/trajectories/{tid}")
        assert r.status_code == 200, r.text
        assert server.trajectory_code(tid) == 404
        rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in [first, *rest[:-1]]]
    assert chunks[-1]["usage"]["completion_tokens"] == 64  # the reply completed normally
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"

    assert server.trajectory_code(tid) == 404  # the request's end did not bring it back
    status = server.status()
    assert status.get("tombstones") == 0, status
    assert tid not in status["trajectory_ids"] and status["trajectories"] == 0

    def nothing_held() -> dict[str, int] | None:
        held = dict(server.status()["bytes_held"])
        return held if not any(held.values()) else None

    held = wait_until(nothing_held, "the deleted trajectory to hold nothing", timeout=5)
    assert held == {"device_pinned": 0, "host": 0, "disk": 0}


def test_late_retain_repins_blocks_still_in_vllms_cache(server: Server) -> None:
    """A pause after the grace period applies: retain pins the blocks vLLM still caches again."""
    tid = "late-retain"
    msgs = _ctx(4200)
    server.chat(msgs, trajectory=tid)
    time.sleep(2.0)  # wall-clock: the grace period (0.3 s) ends and the engine demotes by itself
    demoted = _branch(server, tid)
    assert demoted["state"] == "offloaded" and demoted["demoted_by"] == "grace_expired", demoted

    out = server.pause(tid, "late-grep", 0.001)
    assert out["decision"]["action"] == "retain", out
    assert out["applied"] is True and out["state"] == "retained", out
    # The pins go on at the engine's next step (engine thread only), which the route's wake-up
    # (or the timer pump's) starts on this idle engine: the answer can come first.
    branch = _wait_branch(
        server,
        tid,
        lambda b: b["pinned_blocks"] == b["blocks"] > 0,
        "the retain's repin (applied at the next engine step)",
        timeout=5,
    )
    assert branch["state"] == "retained"
    # (vLLM's reset_prefix_cache would fail now: pinned blocks are in use.)
    resumed = _next(msgs, 4201)
    expected = full_blocks(lcp(server.tokenize(msgs), server.tokenize(resumed)))
    assert expected >= (branch["blocks"] - 1) * 128
    got = server.chat(resumed, trajectory=tid)
    stats = got["kv_transfer_params"]["agentkv"]
    assert stats["device_hit_tokens"] == expected and stats["tier_hit_tokens"] == 0, stats
    server.end(tid)


def test_late_disk_decision_moves_host_copies_to_disk(server: Server) -> None:
    tid = "late-disk"
    server.chat(_ctx(4300), trajectory=tid)
    time.sleep(2.0)  # wall-clock: grace over, the engine offloaded it to host by itself
    demoted = _branch(server, tid)
    assert demoted["state"] == "offloaded" and demoted["tier"] == "host", demoted

    out = server.pause(tid, "late-approval", 3600.0)
    assert out["decision"]["action"] == "offload_disk", out
    assert out["applied"] is True, out
    blocks = demoted["blocks"]
    branch = _wait_branch(
        server,
        tid,
        lambda b: b["state"] == "offloaded" and b["residency_blocks"].get("disk", 0) == blocks,
        "every block to reach disk",
    )
    assert branch["tier"] == "disk"
    assert branch["residency_blocks"].get("host", 0) == 0, branch
    assert branch["pinned_blocks"] == 0
    server.end(tid)


def test_timers_fire_on_an_idle_server(server: Server) -> None:
    """With no request and no route call at all after the pauses: a lease runs out and its
    offload completes, and a disk -> host prefetch starts at its predicted time (a declared wait
    of 6 s goes to disk, prefetch due at p10 = 3 s minus the reload time)."""
    server.clean(tiers=False)  # no other lease may run out meanwhile
    leased, prefetched = "idle-lease", "idle-prefetch"
    counters = server.counters()
    server.chat(_ctx(4400), trajectory=leased)
    out = server.pause(leased, "idle-grep", 0.001, max_lease_s=3.0)
    assert out["decision"]["action"] == "retain" and out["decision"]["lease_s"] == 3.0, out
    lease_end = time.monotonic() + out["decision"]["lease_s"]
    server.chat(_ctx(4500), trajectory=prefetched)
    paused = time.monotonic()
    out = server.pause(prefetched, "idle-build", 6.0)
    assert out["decision"]["action"] == "offload_disk", out
    # Wall-clock, no calls: the prefetch (~3 s), the lease's end, then its offload.
    time.sleep(max(lease_end + 2.0, paused + 6.0) - time.monotonic())

    b = _branch(server, leased)  # the first call since the pauses
    # Already offloaded, not just starting to be: the expiry did not wait for this call.
    assert b["state"] == "offloaded" and b["demoted_by"] == "lease_expired", b
    assert b["pinned_blocks"] == 0 and b["tier"] in ("host", "disk"), b
    assert b["residency_blocks"].get(b["tier"], 0) == b["blocks"] > 0, b

    b = _branch(server, prefetched)
    prefetch = b.get("prefetch") or {}
    due, done = prefetch.get("due_after_pause_s"), prefetch.get("done_after_pause_s")
    assert due is not None and 2.0 <= due <= 3.0, b
    assert done is not None and due <= done <= due + 1.5, b
    assert b["residency_blocks"].get("host", 0) == b["blocks"] > 0, b
    after = server.counters()
    assert after.get("prefetches", 0) - counters.get("prefetches", 0) == 1
    lease_expired = after.get("lease_expired_demotions", 0)
    assert lease_expired - counters.get("lease_expired_demotions", 0) == 1
    server.end(leased)
    server.end(prefetched)
