"""Device prefetch end to end (docs/prefetch.md): a trajectory offloaded to disk with a predicted
2 s tool wait is back in device blocks before its next turn, which is then a vLLM prefix-cache
hit (no tier load); a turn that comes before the prefetch (0.5 s) still gets exact KV.

Its own server: ``device_prefetch`` on, ``disk_after_s`` 1 (a declared 2 s wait goes to disk).
The only sleeps are the tool's wall-clock run (the scenario); state is polled.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Server, full_blocks, lcp, long_text, start_server, wait_until

pytestmark = pytest.mark.e2e


def _connector(work: Path) -> dict[str, Any]:
    return {
        "disk_dir": str(work / "disk"),
        "host_capacity_gib": 0.5,
        "disk_capacity_gib": 2,
        "grace_s": 0.3,
        "disk_after_s": 1,
        "device_prefetch": True,
    }


@pytest.fixture(scope="module")
def prefetch_server() -> Iterator[Server]:
    work = Path(tempfile.mkdtemp(prefix="agentkv-e2e-prefetch-"))
    with start_server(work, _connector(work)) as srv:
        yield srv


def _turns(seed: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    first = [
        {"role": "system", "content": "You are a coding agent. " + long_text(seed, 400)},
        {"role": "user", "content": "Run the tests."},
    ]
    second = [*first, {"role": "user", "content": "Observation: " + long_text(seed + 1, 60)}]
    return first, second


def _tokens_and_logprobs(out: dict[str, Any]) -> list[tuple[str, float]]:
    return [(c["token"], c["logprob"]) for c in out["choices"][0]["logprobs"]["content"]]


def _prefetch(server: Server) -> dict[str, Any]:
    return dict(server.status()["device_prefetch"])


def _offloaded_to_disk(server: Server, tid: str, tool: str, seed: int) -> tuple[float, Any]:
    """Turn 1, a pause with a declared 2 s wait (disk), vLLM's own cache emptied: only the
    disk tier holds the context. Returns (the pause's time, the vanilla reference's answer)."""
    first, second = _turns(seed)
    # Vanilla reference (salted: its own blocks): the same two turns from vLLM's prefix cache.
    server.chat(first, salt=f"ref-{tid}")
    ref = server.chat(second, salt=f"ref-{tid}")
    server.chat(first, trajectory=tid)
    decision = server.pause(tid, tool, 2.0)
    paused = time.monotonic()
    assert decision["decision"]["action"] == "offload_disk", decision
    server.wait_state(tid, {"offloaded"})
    server.reset_prefix_cache()  # the device copy goes; the disk copy stays
    assert time.monotonic() - paused < 0.8, "set-up outlasted the prefetch's due time"
    return paused, ref


def test_a_resume_at_the_predicted_return_is_a_device_hit(prefetch_server: Server) -> None:
    _on_time(prefetch_server, "prefetch-on-time", "prefetch-pytest", 4000)


@pytest.mark.tp2
def test_tp2_a_resume_at_the_predicted_return_is_a_device_hit() -> None:
    """TP=2 (one rank per core): the manager orders once, both ranks load their shard of the
    internal request's blocks; the resume is a device hit with exact output."""
    work = Path(tempfile.mkdtemp(prefix="agentkv-e2e-prefetch-tp2-"))
    with start_server(
        work,
        _connector(work),
        vllm_args=("--tensor-parallel-size", "2"),
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    ) as server:
        _on_time(server, "prefetch-tp2", "prefetch-tp2-pytest", 6000)


def _on_time(server: Server, tid: str, tool: str, seed: int) -> None:
    before = _prefetch(server)
    paused, ref = _offloaded_to_disk(server, tid, tool, seed)
    # The prefetch loads the disk copy into device blocks and pins them (RETAINED).
    server.wait_state(tid, {"retained"}, timeout=2.4)
    assert server.counters().get("device_prefetch_repins", 0) == 0  # it went through a load
    time.sleep(max(0.0, paused + 2.5 - time.monotonic()))  # the tool runs for 2.5 s
    first, second = _turns(seed)
    got = server.chat(second, trajectory=tid)
    stats = got["kv_transfer_params"]["agentkv"]
    ref_cached = ref["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert ref_cached == full_blocks(lcp(server.tokenize(first), server.tokenize(second)))
    assert stats["device_hit_tokens"] == ref_cached and stats["tier_hit_tokens"] == 0, stats
    assert _tokens_and_logprobs(got) == _tokens_and_logprobs(ref)
    after = _prefetch(server)
    assert after["on_time"] == before["on_time"] + 1, after
    assert after["per_tool"][tool]["on_time"] == 1
    assert len(server.trajectory(tid)["turns"]) == 2  # the internal request is no turn
    server.end(tid)


def test_a_resume_before_the_prefetch_still_gets_exact_kv(prefetch_server: Server) -> None:
    server = prefetch_server
    tid, tool = "prefetch-late", "prefetch-late-pytest"
    before = _prefetch(server)
    paused, ref = _offloaded_to_disk(server, tid, tool, 5000)
    time.sleep(max(0.0, paused + 0.5 - time.monotonic()))  # the tool returns at 0.5 s
    _, second = _turns(5000)
    got = server.chat(second, trajectory=tid)
    stats = got["kv_transfer_params"]["agentkv"]
    ref_cached = ref["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert stats["tier_hit_tokens"] == ref_cached and stats["tier"] == "disk", stats
    assert _tokens_and_logprobs(got) == _tokens_and_logprobs(ref)
    after = _prefetch(server)
    assert after["late"] == before["late"] + 1, after
    # Nothing was ordered for it afterwards, and nothing stays pinned once it ends.
    server.end(tid)
    wait_until(
        lambda: server.status()["bytes_held"]["device_pinned"] == 0, "no pinned device block"
    )
