"""SchedulerSide state logic on a simulated engine: pressure demotion, admission wait, prefetch.

The e2e tests run these paths inside the real vLLM; here the clock and the pool's use are set by
the test, so the rules themselves (victim order, how many are demoted, when a prefetch fires,
how long a new trajectory waits) are checked exactly. The block pool is a stand-in with vLLM's
reference-count interface (touch / free_blocks / get_usage); nothing here moves KV.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from agentkv.metrics import counter_value
from agentkv.trajectories import BranchState
from agentkv_vllm import scheduler_side
from agentkv_vllm.scheduler_side import SchedulerSide
from agentkv_vllm.settings import ConnectorSettings

BLOCK = 16
NUM_BLOCKS = 101  # vLLM reserves block 0: 100 usable


@dataclass
class _Block:
    block_id: int
    ref_cnt: int = 0


@dataclass
class SimPool:
    """vLLM's BlockPool surface that SchedulerSide uses; ``busy`` = blocks running requests use."""

    num_gpu_blocks: int = NUM_BLOCKS
    busy: int = 0
    blocks: list[_Block] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.blocks = [_Block(i) for i in range(self.num_gpu_blocks)]

    def touch(self, blocks: list[_Block]) -> None:
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, blocks: Any) -> None:
        for b in blocks:
            assert b.ref_cnt > 0, f"block {b.block_id} freed more often than touched"
            b.ref_cnt -= 1

    def get_usage(self) -> float:
        pinned = sum(1 for b in self.blocks if b.ref_cnt > 0)
        return (pinned + self.busy) / (self.num_gpu_blocks - 1)


def _sim(**settings: Any) -> tuple[SchedulerSide, SimPool]:
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 8192,
        "torch_dtype": "bfloat16",
    }
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BLOCK),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        model_config=SimpleNamespace(
            model="sim-model", dtype="bfloat16", hf_config=SimpleNamespace(to_dict=lambda: hf)
        ),
    )
    group = SimpleNamespace(
        layer_names=[f"l{i}" for i in range(4)],
        kv_cache_spec=SimpleNamespace(page_size_bytes=BLOCK * 2 * 2 * 64 * 2),
    )
    kv_cache_config = SimpleNamespace(kv_cache_groups=[group])
    s = ConnectorSettings.model_validate(
        {"grace_s": 60, "lease_margin_s": 30, "profile_path": "/nonexistent", **settings}
    )
    side = SchedulerSide(vllm_config, kv_cache_config, s)
    pool = SimPool()
    side.block_pool = pool
    return side, pool


_next_block = [1]


def _request(tid: str, n_tokens: int, seed: int) -> Any:
    tokens = [(seed * 7919 + i) % 8000 for i in range(n_tokens)]
    return SimpleNamespace(
        request_id=f"{tid}-{seed}-{time.monotonic_ns()}",
        kv_transfer_params={"agentkv": {"trajectory_id": tid}},
        num_prompt_tokens=n_tokens,
        prompt_token_ids=tokens,
        all_token_ids=tokens,
        num_computed_tokens=n_tokens,
        cache_salt=None,
        lora_request=None,
        mm_features=None,
    )


def _turn(side: SchedulerSide, tid: str, n_blocks: int, seed: int) -> list[int]:
    """One finished turn of ``tid`` holding ``n_blocks`` full blocks (pinned, HELD)."""
    req = _request(tid, n_blocks * BLOCK, seed)
    n, _ = side.lookup(req, 0)
    assert n == 0
    ids = list(range(_next_block[0], _next_block[0] + n_blocks))
    _next_block[0] += n_blocks
    side.finish(req, ids)
    side._engine_tick()
    return ids


def _pause(side: SchedulerSide, tid: str, wait: float) -> dict[str, Any]:
    status, body = side.handle(
        {"op": "pause", "trajectory_id": tid, "tool": "t", "expected_wait_s": wait}
    )
    assert status == 200, body
    return body


@pytest.fixture(autouse=True)
def _reset_blocks() -> None:
    _next_block[0] = 1


def test_pressure_demotes_farthest_return_first_and_only_as_many_as_needed() -> None:
    side, pool = _sim(high_water=0.8)
    for seed, tid in enumerate(("near", "far", "mid")):
        _turn(side, tid, 20, seed=seed)
        assert _pause(side, tid, 0.0001)["decision"]["action"] == "retain"
    # Predictions that disagree with pause order: "far" paused second but returns last.
    now = time.monotonic()
    for tid, ret in (("near", 5.0), ("far", 500.0), ("mid", 50.0)):
        branch = side.table.get(tid).branches["main"]  # type: ignore[union-attr]
        branch.predicted_return_at = now + ret
    assert pool.get_usage() == pytest.approx(0.6)
    pool.busy = 30  # a running request: 90% used, 10 points over high water -> one victim
    side._engine_tick()
    states = {tid: side.table.get(tid).branches["main"].state for tid in ("near", "far", "mid")}  # type: ignore[union-attr]
    assert states == {
        "near": BranchState.RETAINED,
        "far": BranchState.OFFLOADING,
        "mid": BranchState.RETAINED,
    }
    assert side.table.get("far").branches["main"].demoted_by == "pressure"  # type: ignore[union-attr]
    assert side.table.get("near").branches["main"].demoted_by is None  # type: ignore[union-attr]
    [job] = side.pending_stores
    assert job.tier == "host" and len(job.blocks) == 20 and job.owner == "far"
    assert side.counters["pressure_demotions"] == 1
    snap = side.metrics_snapshot()
    assert counter_value(snap, "agentkv_demotions", reason="pressure") == 1

    pool.busy = 55  # now 60 + 55 = 115% of the pool: both remaining go, "mid" before "near"
    side._engine_tick()
    assert side.counters["pressure_demotions"] == 3
    assert [j.owner for j in side.pending_stores] == ["far", "mid", "near"]


def test_admission_waits_above_high_water_for_new_trajectories_only(monkeypatch: Any) -> None:
    side, pool = _sim(high_water=0.5, admission_wait=True)
    _turn(side, "old", 10, seed=1)
    pool.busy = 60  # 70% used, all by running requests: no retained branch to demote
    new = _request("new", 64, seed=2)
    assert side.lookup(new, 0) == (None, False)  # None: vLLM asks again next step
    assert side.counters["admission_waits"] == 1
    # A trajectory already running keeps going: waiting would stall a live agent.
    old_turn = _request("old", 10 * BLOCK + 40, seed=1)
    assert side.lookup(old_turn, 0)[0] is not None
    # The wait is bounded: after ADMISSION_MAX_WAIT_S the new one is admitted anyway.
    monkeypatch.setattr(scheduler_side, "ADMISSION_MAX_WAIT_S", 0.0)
    assert side.lookup(new, 0)[0] is not None


def test_no_admission_wait_unless_enabled() -> None:
    side, pool = _sim(high_water=0.5)
    pool.busy = 90
    assert side.lookup(_request("new", 64, seed=3), 0)[0] is not None
    assert side.counters["admission_waits"] == 0


def test_disk_prefetch_fires_at_predicted_time_and_is_scored_on_resume() -> None:
    side, _ = _sim(disk_dir="/nonexistent-agentkv-sim")
    _turn(side, "human", 8, seed=4)
    body = _pause(side, "human", 3600.0)
    assert body["decision"]["action"] == "offload_disk"
    branch = side.table.get("human").branches["main"]  # type: ignore[union-attr]
    [job] = side.build_step().stores
    # The worker reports the store done: blocks are indexed on disk, the device pin released.
    report = SimpleNamespace(
        kv_connector_worker_meta=scheduler_side.AgentKVWorkerReport(
            stores_done={job.job_id: 1},
            transfers={("offload", "disk", f"job-{job.job_id}"): (8 * 4096, 0.01)},
        ),
        invalid_block_ids=None,
    )
    side.on_worker_report(report)
    assert branch.state is BranchState.OFFLOADED and branch.tier == "disk"
    assert branch.prefetch_at is not None
    assert all(side.index.tier_of(k) == "disk" for k in branch.keys)

    # Due at the wait's p10 minus the reload time, so ~90% of returns find the blocks in host.
    p10 = body["wait_estimate"]["p10"]
    assert p10 - 60 < branch.prefetch_at - branch.paused_at <= p10  # type: ignore[operator]
    side._state_tick(time.monotonic())
    assert side.pending_promotes == []  # not yet
    branch.prefetch_at = time.monotonic()  # fast-forward: its time has come
    side._state_tick(time.monotonic())
    assert sorted(side.pending_promotes) == sorted(branch.keys)
    assert all(side.index.tier_of(k) == "host" for k in branch.keys)
    assert side.counters["prefetches"] == 1
    side._state_tick(time.monotonic())
    assert len(side.pending_promotes) == len(branch.keys)  # fires once

    # The agent returns: the prefetch finished before it, so it is scored (early or on time).
    _, resumed = side.handle({"op": "resume", "trajectory_id": "human"})
    assert resumed["state"] == "offloaded"
    counts = side.prefetch_outcomes.counts()
    assert sum(counts.values()) == 1 and counts.get("late", 0) == 0
    snap = side.metrics_snapshot()
    assert counter_value(snap, "agentkv_prefetch_outcomes") == 1
    assert counter_value(snap, "agentkv_decisions", action="offload_disk") == 1
