"""Scheduler side of AgentKVConnector: what each trajectory holds, and what to do with it.

Primitives (engine thread, called from vLLM's scheduler hooks):
  lookup(request, num_computed)        tokens beyond the local hit that the tiers hold
  plan_load(request, blocks, n_ext)    turn a lookup into a LoadJob on the allocated blocks
  finish(request, block_ids)           pin the finished context, start its grace period,
                                       return the turn's prefix statistics
  build_step()                         the step's jobs for the workers
  on_worker_report(output)             finished stores -> unpin, index; failed loads -> forget
  has_pending_work()                   keep the engine stepping while transfers are pending
Primitives (control thread, from the HTTP routes): ``handle(op)`` with ops pause, resume, end,
get, status, metrics (the ``agentkv.metrics`` snapshot the server's /metrics is built from).

Every event also feeds ``self.metrics`` (Prometheus, pulled through the metrics op) and, when the
standard OTEL_* variables configure it, an OTLP export with one span per pause -> resume cycle.

Both threads share one lock. Only the engine thread touches vLLM's block pool (pin/unpin);
the control thread changes states and queues work, then the route nudges the engine.

Pins use the block pool's own reference counts (``touch`` / ``free_blocks``): a pinned block can't
be evicted, and once unpinned it goes back to vLLM's prefix cache with its hash, still reusable
until vLLM needs the memory (write-back offload).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from agentkv import metrics as m
from agentkv.block_index import BlockIndex
from agentkv.metrics import MetricSpec, MetricsRecorder, Snapshot
from agentkv.otel_export import OTelExport
from agentkv.policy import CostModel, Decision, PolicyParams, decide
from agentkv.predict import PrefetchOutcomeCounter, WaitPredictor, classify_prefetch, prefetch_at
from agentkv.profile import load_profile
from agentkv.tiers.keys import ModelFingerprint, chain_keys
from agentkv.trajectories import PAUSED_STATES, Branch, BranchState, TrajectoryTable, TurnStats
from agentkv_vllm import plugin
from agentkv_vllm.metadata import (
    AgentKVStepMetadata,
    AgentKVWorkerReport,
    BlockTransfer,
    LoadJob,
    StoreJob,
)
from agentkv_vllm.params import AgentKVParams, parse_request_params
from agentkv_vllm.settings import ConnectorSettings

log = logging.getLogger("agentkv.scheduler")
GiB = 1 << 30
ADMISSION_MAX_WAIT_S = 5.0


@dataclass
class _Job:
    job: StoreJob
    trajectory_id: str
    branch: str
    block_ids: list[int]
    ranks_done: int = 0
    failed: bool = False


@dataclass
class _RequestInfo:
    params: AgentKVParams
    turn: TurnStats
    load_start_block: int = 0
    load_keys: list[bytes] = field(default_factory=list)
    load_tier: str | None = None
    load_layerwise: bool = False
    first_seen: float = 0.0


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


class SchedulerSide:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, settings: ConnectorSettings) -> None:
        self.settings = settings
        self.block_size: int = vllm_config.cache_config.block_size
        self.tp_size: int = vllm_config.parallel_config.tensor_parallel_size
        model_config = vllm_config.model_config
        groups = kv_cache_config.kv_cache_groups
        num_layers = sum(len(g.layer_names) for g in groups)
        page = groups[0].kv_cache_spec.page_size_bytes if groups else 0
        self.block_bytes_per_rank = page * num_layers
        self.block_bytes_total = self.block_bytes_per_rank * self.tp_size
        self.fingerprint = ModelFingerprint(
            model_id=str(model_config.model),
            dtype=str(model_config.dtype),
            block_size=self.block_size,
            num_layers=num_layers,
            tp_rank=-1,
            tp_size=self.tp_size,
            layout="logical-v1",
        )
        self.host_capacity_blocks = int(settings.host_capacity_gib * GiB) // max(
            1, self.block_bytes_per_rank
        )
        self.disk_capacity_blocks = (
            int(settings.disk_capacity_gib * GiB) // max(1, self.block_bytes_per_rank + 8192)
            if settings.disk_dir
            else 0
        )
        self.lock = threading.RLock()
        self.table = TrajectoryTable()
        self.index = BlockIndex()
        self.inflight: dict[bytes, int] = {}
        self.jobs: dict[int, _Job] = {}
        self._next_job = 1
        self.requests: dict[str, _RequestInfo] = {}
        self.pending_stores: list[StoreJob] = []
        self.pending_loads: list[LoadJob] = []
        self.pending_drops: list[bytes] = []
        self.pending_promotes: list[bytes] = []
        self.pending_unpins: list[list[int]] = []
        self.block_pool: Any = None
        self.predictor = WaitPredictor()
        self.prefetch_outcomes = PrefetchOutcomeCounter()
        self.counters: Counter[str] = Counter()
        self.decisions: Counter[str] = Counter()
        self.worker_pids: dict[int, int] = {}
        self.metrics = MetricsRecorder()
        self.otel = OTelExport.from_env(self._gauges)
        self.metrics.sink = self.otel
        self.profile = load_profile(settings.profile_path)
        params = None
        try:
            from agentkv.geometry import ModelGeometry

            geom = ModelGeometry.from_hf_config(model_config.hf_config.to_dict())
            params = geom.num_parameters
            layers, hidden = geom.num_layers, geom.hidden_size
        except Exception as exc:  # sizing is best effort; decisions fall back safely
            log.info("agentkv: model size unknown (%s); recompute cost from the profile only", exc)
            layers, hidden = 0, 0
        self.costs = CostModel.from_profile(
            self.profile, model_params=params, num_layers=layers, hidden_size=hidden
        )
        self.policy = PolicyParams(max_lease_s=settings.max_lease_s)
        device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu"))
        self.layerwise = settings.load_mode == "layerwise" or (
            settings.load_mode == "auto" and device == "cpu"
        )
        self.started_at = time.time()

    # ------------------------------------------------------------------ keys and params

    def _keys(self, token_ids: Any, n_blocks: int, salt: str | None) -> list[bytes]:
        if n_blocks <= 0:
            return []
        bs = self.block_size
        arr = np.asarray(token_ids[: n_blocks * bs], dtype=np.int64)
        digests = [
            xxhash.xxh3_128_digest(arr[i * bs : (i + 1) * bs].tobytes()) for i in range(n_blocks)
        ]
        return [k.digest for k in chain_keys(self.fingerprint, salt, digests)]

    def _info(self, request: Any) -> _RequestInfo | None:
        info = self.requests.get(request.request_id)
        if info is not None:
            return info
        result = parse_request_params(getattr(request, "kv_transfer_params", None))
        if result.warning:
            self.counters["malformed_params"] += 1
            log.warning(
                "agentkv: request %s served as vanilla: %s", request.request_id, result.warning
            )
        if result.params is None:
            return None
        if getattr(request, "lora_request", None) is not None or getattr(
            request, "mm_features", None
        ):
            # Token ids alone do not address such KV; serving it from a tier could be wrong.
            self.counters["unsupported_requests"] += 1
            return None
        traj = self.table.get(result.params.trajectory_id)
        turn = TurnStats(
            turn=(len(traj.turns) if traj else 0) + 1,
            branch=result.params.branch,
            prompt_tokens=request.num_prompt_tokens,
        )
        info = _RequestInfo(result.params, turn, first_seen=time.monotonic())
        self.requests[request.request_id] = info
        return info

    # ------------------------------------------------------------------ engine-thread hooks

    def lookup(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        with self.lock:
            self._engine_tick()
            info = self._info(request)
            if info is None:
                return 0, False
            now = time.monotonic()
            traj = self.table.get(info.params.trajectory_id)
            if (
                self.settings.admission_wait
                and (traj is None or not traj.turns)
                and self._pool_usage() > self.settings.high_water
                and now - info.first_seen < ADMISSION_MAX_WAIT_S
            ):
                # A new trajectory waits for pressure demotion rather than evicting live ones.
                self.counters["admission_waits"] += 1
                return None, False
            traj = self.table.get_or_create(info.params.trajectory_id, now)
            branch = traj.branch(info.params.branch)
            self._note_resume(traj.trajectory_id, branch, now)
            branch.state = BranchState.ACTIVE
            branch.running_requests.add(request.request_id)
            bs = self.block_size
            prompt = list(request.prompt_token_ids or [])
            # Diagnostics: where this prompt leaves the branch's previous context.
            if branch.token_ids:
                lcp = _lcp(branch.token_ids, prompt)
                if lcp < min(len(branch.token_ids), len(prompt)):
                    info.turn.first_divergence_token = lcp
                    info.turn.divergence_zone = _zone_at(info.params, lcp)
            info.turn.device_hit_tokens = num_computed
            n_max = (request.num_prompt_tokens - 1) // bs  # vLLM must compute the last token
            start = num_computed // bs
            if start >= n_max or not prompt:
                return 0, False
            keys = self._keys(prompt, n_max, request.cache_salt)
            count = 0
            tiers: set[str] = set()
            for k in keys[start:n_max]:
                tier = self.index.tier_of(k)
                if tier is None or k in self.inflight:
                    break
                tiers.add(tier)
                count += 1
            if count == 0:
                return 0, False
            info.load_start_block = start
            info.load_keys = keys[start : start + count]
            info.load_tier = "disk" if "disk" in tiers else "host"
            # Host blocks can be copied per layer inside the step; disk blocks are verified whole.
            info.load_layerwise = self.layerwise and tiers == {"host"}
            return count * bs, not info.load_layerwise

    def plan_load(self, request: Any, blocks: Any, num_external: int) -> None:
        with self.lock:
            info = self.requests.get(request.request_id)
            if info is None:
                return
            traj = self.table.get(info.params.trajectory_id)
            branch = traj.branch(info.params.branch) if traj else None
            if branch is not None and branch.pinned_block_ids:
                # The request now holds its own references to the blocks it hit.
                self._unpin(branch.pinned_block_ids)
                branch.pinned_block_ids = []
            if num_external <= 0 or not info.load_keys:
                return
            n = num_external // self.block_size
            block_ids = blocks.get_block_ids()[0]
            start = info.load_start_block
            targets = block_ids[start : start + n]
            keys = info.load_keys[:n]
            if len(targets) != len(keys):
                # vLLM already counts these tokens as external: send keys no tier holds, so every
                # target block fails to load and vLLM recomputes it (never stale KV, never a hang).
                log.warning("agentkv: load plan mismatch for %s; recomputing", request.request_id)
                keys = [b""] * len(targets)
            self.pending_loads.append(
                LoadJob(
                    request.request_id,
                    [BlockTransfer(k, b) for k, b in zip(keys, targets, strict=True)],
                    layerwise=info.load_layerwise,
                )
            )
            if info.load_layerwise:
                self.counters["layerwise_loads"] += 1
            info.turn.tier_hit_tokens = n * self.block_size
            info.turn.tier = info.load_tier
            info.load_keys = []
            self.counters["loads"] += 1
            self.counters["load_blocks"] += n

    def finish(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        with self.lock:
            info = self.requests.pop(request.request_id, None)
            if info is None:
                return False, None
            now = time.monotonic()
            traj = self.table.get_or_create(info.params.trajectory_id, now)
            traj.turns.append(info.turn)
            branch = traj.branch(info.params.branch)
            branch.running_requests.discard(request.request_id)
            bs = self.block_size
            computed = max(
                0, request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
            )
            n_full = min(len(block_ids), computed // bs)
            tokens = list(request.all_token_ids)
            branch.token_ids = tokens[: max(computed, 0)]
            branch.keys = self._keys(tokens, n_full, request.cache_salt)
            if branch.pinned_block_ids:
                self._unpin(branch.pinned_block_ids)
            pinned = [b for b in block_ids[:n_full] if b is not None and b >= 0]
            self._pin(pinned)
            branch.pinned_block_ids = pinned
            branch.state = BranchState.HELD
            branch.held_until = now + self.settings.grace_s
            pending = (
                branch.decision if branch.decision and branch.decision.get("_pending") else None
            )
            if pending is not None:
                branch.decision = {k: v for k, v in pending.items() if k != "_pending"}
                self._apply(
                    traj.trajectory_id,
                    branch,
                    str(pending["action"]),
                    float(pending.get("_lease") or 0),
                    now,
                )
            elif self.settings.grace_s <= 0:
                self._apply(traj.trajectory_id, branch, self.settings.default_action, 0.0, now)
            self._record_turn(info.turn)
            stats = info.turn.to_dict()
            stats["trajectory_id"] = traj.trajectory_id
            stats["prefix_hit_ratio"] = round(traj.prefix_hit_ratio, 6)
            return False, {"agentkv": stats}

    def build_step(self) -> AgentKVStepMetadata:
        with self.lock:
            self._engine_tick()
            meta = AgentKVStepMetadata(
                stores=self.pending_stores,
                loads=self.pending_loads,
                drop_keys=self.pending_drops,
                promote_keys=self.pending_promotes,
            )
            self.pending_stores, self.pending_loads, self.pending_drops, self.pending_promotes = (
                [],
                [],
                [],
                [],
            )
            return meta

    def on_worker_report(self, output: Any) -> None:
        report = getattr(output, "kv_connector_worker_meta", None)
        with self.lock:
            if isinstance(report, AgentKVWorkerReport):
                self.worker_pids.update(report.hello)
                for job_id in report.stores_failed:
                    if job_id in self.jobs:
                        self.jobs[job_id].failed = True
                for job_id, n in report.stores_done.items():
                    job = self.jobs.get(job_id)
                    if job is None:
                        continue
                    job.ranks_done += n
                    if job.ranks_done >= self.tp_size:
                        self._complete(job)
                for key in report.missing_keys:
                    self._forget(key)
                    self.counters["tier_misses"] += 1
                for (kind, tier, _), (nbytes, seconds) in report.transfers.items():
                    off = kind == "offload"
                    self.metrics.observe(
                        m.OFFLOAD_BYTES if off else m.RELOAD_BYTES, float(nbytes), tier=tier
                    )
                    self.metrics.observe(
                        m.OFFLOAD_SECONDS if off else m.RELOAD_SECONDS, seconds, tier=tier
                    )
            if getattr(output, "invalid_block_ids", None):
                self.counters["load_failed_blocks"] += len(output.invalid_block_ids)

    def has_pending_work(self) -> bool:
        with self.lock:
            if (
                self.pending_stores
                or self.pending_loads
                or self.pending_drops
                or self.pending_promotes
            ):
                return True
            if self.pending_unpins or self.jobs:
                return True
            return any(b.state is BranchState.HELD for _, b in self.table.branches())

    # ------------------------------------------------------------------ internals

    def _pool_usage(self) -> float:
        try:
            return float(self.block_pool.get_usage()) if self.block_pool is not None else 0.0
        except Exception:
            return 0.0

    def _pin(self, block_ids: list[int]) -> None:
        if self.block_pool is None or not block_ids:
            return
        self.block_pool.touch([self.block_pool.blocks[b] for b in block_ids])

    def _unpin(self, block_ids: list[int]) -> None:
        """Queue: the control thread may call this; the engine thread applies it."""
        if block_ids:
            self.pending_unpins.append(list(block_ids))

    def _engine_tick(self) -> None:
        """Engine thread only: apply queued unpins, then expiry, pressure and prefetch."""
        if self.pending_unpins and self.block_pool is not None:
            for ids in self.pending_unpins:
                # Reverse order: vLLM evicts the tail of a freed run first, keeping the shared head.
                self.block_pool.free_blocks([self.block_pool.blocks[b] for b in reversed(ids)])
            self.pending_unpins = []
        self._state_tick(time.monotonic())

    def _state_tick(self, now: float) -> None:
        for traj, branch in self.table.expired(now):
            if branch.state is BranchState.HELD:
                self.counters["grace_expired"] += 1
                self.metrics.add(m.DEMOTIONS, reason="grace_expired")
                branch.demoted_by = "grace_expired"
                self._apply(traj.trajectory_id, branch, self.settings.default_action, 0.0, now)
            else:
                self.counters["lease_expired_demotions"] += 1
                self.metrics.add(m.DEMOTIONS, reason="lease_expired")
                branch.demoted_by = "lease_expired"
                self._apply(traj.trajectory_id, branch, "offload_host", 0.0, now)
        usage = self._pool_usage()
        if usage > self.settings.high_water and self.block_pool is not None:
            total = max(1, self.block_pool.num_gpu_blocks - 1)
            for traj, branch in self.table.pressure_victims():
                if usage <= self.settings.high_water:
                    break
                if branch.state is not BranchState.RETAINED:
                    continue
                usage -= len(branch.pinned_block_ids) / total
                self.counters["pressure_demotions"] += 1
                self.metrics.add(m.DEMOTIONS, reason="pressure")
                branch.demoted_by = "pressure"
                self._apply(traj.trajectory_id, branch, "offload_host", 0.0, now)
        for _, branch in self.table.branches():
            if (
                branch.state is BranchState.OFFLOADED
                and branch.tier == "disk"
                and branch.prefetch_at is not None
                and branch.prefetched_at is None
                and now >= branch.prefetch_at
            ):
                self._promote_to_host(branch, now)
                self.counters["prefetches"] += 1

    def _promote_to_host(self, branch: Branch, now: float) -> None:
        """Queue disk -> host copies of the branch's disk blocks (a prefetch or a resume)."""
        keys = [k for k in branch.keys if self.index.tier_of(k) == "disk"]
        self.pending_promotes.extend(keys)
        for k in keys:
            self.index.move(k, "host")
        branch.prefetched_at = now

    def _apply(
        self, trajectory_id: str, branch: Branch, action: str, lease_s: float, now: float
    ) -> None:
        """Carry out a decision for a branch whose blocks are pinned (HELD or RETAINED)."""
        if action == "retain":
            branch.state = BranchState.RETAINED
            branch.lease_until = now + max(0.0, min(lease_s, self.settings.max_lease_s))
            return
        if action in ("offload_host", "offload_disk"):
            tier = "disk" if action == "offload_disk" and self.settings.disk_dir else "host"
            transfers, skip = [], []
            owner = trajectory_id
            keys = branch.keys[: len(branch.pinned_block_ids)]
            for key, bid in zip(keys, branch.pinned_block_ids, strict=False):
                held = self.index.tier_of(key)
                # Already in the wanted tier, or in host when host was wanted (or better), or
                # being written: share it rather than copy it again.
                if key in self.inflight or (held is not None and (held == tier or tier == "host")):
                    if held is not None:
                        self.index.add_owner(key, owner)
                    skip.append(bid)
                else:
                    transfers.append(BlockTransfer(key, bid))
            self._unpin(skip)
            branch.tier = tier
            if not transfers:
                branch.pinned_block_ids = []
                branch.state = BranchState.OFFLOADED
                return
            job_id = self._next_job
            self._next_job += 1
            job = StoreJob(job_id, tier, transfers, owner=owner)
            self.jobs[job_id] = _Job(
                job, trajectory_id, branch.name, [t.block_id for t in transfers]
            )
            for t in transfers:
                self.inflight[t.key] = job_id
            self.pending_stores.append(job)
            branch.pinned_block_ids = []
            branch.state = BranchState.OFFLOADING
            self.counters["stores"] += 1
            self.counters["store_blocks"] += len(transfers)
            return
        # drop (or anything unknown): give the blocks back to vLLM, keep nothing.
        self._unpin(branch.pinned_block_ids)
        branch.pinned_block_ids = []
        branch.state = BranchState.DROPPED
        branch.tier = None

    def _complete(self, job: _Job) -> None:
        self.jobs.pop(job.job.job_id, None)
        self._unpin(job.block_ids)
        traj = self.table.get(job.trajectory_id)
        for t in job.job.blocks:
            self.inflight.pop(t.key, None)
        if job.failed:
            self.counters["store_failures"] += 1
        elif traj is None:
            # ended while the copy was in flight: drop what was written for it
            self.pending_drops.extend(t.key for t in job.job.blocks)
        else:
            for t in job.job.blocks:
                self.index.put(t.key, job.job.tier, job.trajectory_id)
        if traj is not None:
            branch = traj.branches.get(job.branch)
            if branch is not None and branch.state is BranchState.OFFLOADING:
                branch.state = BranchState.DROPPED if job.failed else BranchState.OFFLOADED

    def _forget(self, key: bytes) -> None:
        self.index.forget(key)

    def _note_resume(self, trajectory_id: str, branch: Branch, now: float) -> None:
        if branch.paused_at is None:
            return
        observed = now - branch.paused_at
        if branch.tool:
            self.predictor.observe(branch.tool, observed)
            self.metrics.observe(m.TOOL_WAIT_OBSERVED, observed, tool=branch.tool)
        outcome = None
        if branch.prefetch_at is not None and branch.tier == "disk":
            outcome = classify_prefetch(branch.prefetched_at, now)
            self.prefetch_outcomes.record(outcome)
            self.metrics.add(m.PREFETCH_OUTCOMES, outcome=outcome)
        if self.otel is not None:
            self.otel.end_pause(
                (trajectory_id, branch.name),
                {
                    "agentkv.outcome": "resumed",
                    "agentkv.observed_wait_s": round(observed, 6),
                    "agentkv.resumed_state": branch.state.value,
                    "agentkv.resumed_tier": branch.tier,
                    "agentkv.prefetch_outcome": outcome,
                },
            )
        branch.paused_at = None
        branch.prefetch_at = None
        branch.prefetched_at = None

    def _tier_free_bytes(self, tier: str) -> float:
        if tier == "disk" and not self.settings.disk_dir:
            return 0.0
        cap = self.host_capacity_blocks if tier == "host" else self.disk_capacity_blocks
        used = self.index.count(tier)
        return float(max(0, cap - used) * self.block_bytes_total)

    # ------------------------------------------------------------------ control ops

    def handle(self, req: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        op = req.get("op")
        with self.lock:
            self._state_tick(time.monotonic())
            if op == "status":
                return 200, self.status()
            if op == "metrics":
                return 200, self.metrics_snapshot()
            if op == "pause":
                return self._op_pause(req)
            if op == "resume":
                return self._op_resume(req)
            if op == "end":
                return self._op_end(req)
            if op == "get":
                traj = self.table.get(str(req.get("trajectory_id")))
                if traj is None:
                    return 404, {"detail": f"unknown trajectory {req.get('trajectory_id')!r}"}
                return 200, self._trajectory_view(traj)
        return 400, {"detail": f"unknown op {op!r}"}

    def _find(
        self, req: dict[str, Any]
    ) -> tuple[Any, Branch | None, tuple[int, dict[str, Any]] | None]:
        tid = str(req.get("trajectory_id"))
        traj = self.table.get(tid)
        if traj is None:
            return None, None, (404, {"detail": f"unknown trajectory {tid!r}"})
        name = str(req.get("branch") or "main")
        branch = traj.branches.get(name)
        if branch is None:
            return traj, None, (404, {"detail": f"trajectory {tid!r} has no branch {name!r}"})
        return traj, branch, None

    def _op_pause(self, req: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        traj, branch, err = self._find(req)
        if err:
            return err
        assert branch is not None
        now = time.monotonic()
        tool = str(req.get("tool") or "unknown")
        declared = req.get("expected_wait_s")
        estimate = self.predictor.predict(tool, float(declared) if declared is not None else None)
        kv_bytes = float(len(branch.keys) * self.block_bytes_total)
        decision: Decision = decide(
            tokens=branch.kv_tokens,
            kv_bytes=kv_bytes,
            wait=estimate,
            costs=self.costs,
            pressure=self._pool_usage(),
            host_free_bytes=self._tier_free_bytes("host"),
            disk_free_bytes=self._tier_free_bytes("disk"),
            params=self.policy,
        )
        action = decision.action
        if action == "offload_disk" and not self.settings.disk_dir:
            action = "offload_host"
        body = decision.to_dict()
        body["action"] = action
        if action == "retain":
            body["lease_s"] = self._lease_for(decision, estimate)
        branch.tool = tool
        branch.paused_at = now
        branch.demoted_by = None
        p50 = estimate.p50 if math.isfinite(estimate.p50) else 0.0
        branch.predicted_return_at = now + p50
        branch.prefetch_at = now + prefetch_at(
            estimate, decision.reload_s if math.isfinite(decision.reload_s) else 0.0
        )
        branch.prefetched_at = None
        self.decisions[action] += 1
        self.metrics.add(m.DECISIONS, action=action)
        if math.isfinite(estimate.p50):
            self.metrics.observe(m.TOOL_WAIT_PREDICTED, estimate.p50, tool=tool)
        if self.otel is not None:
            self.otel.start_pause(
                (traj.trajectory_id, branch.name),
                {
                    "agentkv.trajectory_id": traj.trajectory_id,
                    "agentkv.branch": branch.name,
                    "agentkv.tool": tool,
                    "agentkv.expected_wait_s": declared,
                    "agentkv.predicted_wait_s": p50_or_none(estimate.p50),
                    "agentkv.action": action,
                    "agentkv.kv_tokens": branch.kv_tokens,
                    "agentkv.kv_bytes": int(kv_bytes),
                    "agentkv.rationale": decision.rationale,
                },
            )
        log.info(
            "agentkv: pause %s/%s tool=%s -> %s (%s)",
            traj.trajectory_id,
            branch.name,
            tool,
            action,
            decision.rationale,
        )
        applied = True
        if branch.state is BranchState.ACTIVE:
            branch.decision = {
                **body,
                "_pending": True,
                "_lease": self._lease_for(decision, estimate),
            }
            applied = False
        elif branch.state in (BranchState.HELD, BranchState.RETAINED):
            branch.decision = body
            self._apply(
                traj.trajectory_id, branch, action, self._lease_for(decision, estimate), now
            )
        else:
            branch.decision = body
            applied = False
        return 200, {
            "trajectory_id": traj.trajectory_id,
            "branch": branch.name,
            "applied": applied,
            "state": branch.state.value,
            "decision": body,
            "wait_estimate": estimate.to_dict(),
        }

    def _lease_for(self, decision: Decision, estimate: Any) -> float:
        """Lease of a retained branch: predicted return plus margin, never past max_lease_s."""
        p50 = estimate.p50 if math.isfinite(estimate.p50) else 0.0
        lease = max(float(decision.lease_s), p50 + self.settings.lease_margin_s)
        return min(lease, self.settings.max_lease_s)

    def _op_resume(self, req: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        traj, branch, err = self._find(req)
        if err:
            return err
        assert branch is not None
        now = time.monotonic()
        observed = now - branch.paused_at if branch.paused_at is not None else None
        if (
            branch.state is BranchState.OFFLOADED
            and branch.tier == "disk"
            and branch.prefetched_at is None
        ):
            self._promote_to_host(branch, now)
        self._note_resume(traj.trajectory_id, branch, now)
        return 200, {
            "trajectory_id": traj.trajectory_id,
            "branch": branch.name,
            "state": branch.state.value,
            "observed_wait_s": observed,
        }

    def _op_end(self, req: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        tid = str(req.get("trajectory_id"))
        traj = self.table.pop(tid)
        if traj is None:
            return 404, {"detail": f"unknown trajectory {tid!r}"}
        released = 0
        for branch in traj.branches.values():
            if branch.paused_at is not None and branch.prefetched_at is not None:
                # Prefetched for a return that never came.
                self.prefetch_outcomes.record("wasted")
                self.metrics.add(m.PREFETCH_OUTCOMES, outcome="wasted")
            if self.otel is not None:
                self.otel.end_pause((tid, branch.name), {"agentkv.outcome": "ended"})
            released += len(branch.pinned_block_ids)
            self._unpin(branch.pinned_block_ids)
            branch.pinned_block_ids = []
            branch.state = BranchState.ENDED
        orphans = self.index.release(tid)  # blocks another trajectory shares stay
        self.pending_drops.extend(orphans)
        dropped = len(orphans)
        return 200, {
            "trajectory_id": tid,
            "released_blocks": released,
            "dropped_tier_blocks": dropped,
        }

    def _trajectory_view(self, traj: Any) -> dict[str, Any]:
        view = traj.to_dict(time.monotonic())
        for name, branch in traj.branches.items():
            residency: Counter[str] = Counter()
            for key in branch.keys:
                tier = self.index.tier_of(key)
                residency[tier or ("in_flight" if key in self.inflight else "none")] += 1
            residency["device_pinned"] = len(branch.pinned_block_ids)
            view["branches"][name]["residency_blocks"] = dict(residency)
        return view

    def _record_turn(self, turn: TurnStats) -> None:
        self.metrics.add(m.PROMPT_TOKENS, float(turn.prompt_tokens))
        self.metrics.add(m.CACHED_TOKENS, float(turn.device_hit_tokens), source="device")
        if turn.tier_hit_tokens:
            self.metrics.add(
                m.CACHED_TOKENS, float(turn.tier_hit_tokens), source=turn.tier or "host"
            )
        if turn.prompt_tokens:
            self.metrics.observe(m.PREFIX_HIT_RATIO, turn.hit_tokens / turn.prompt_tokens)
        if turn.first_divergence_token is not None:
            self.metrics.add(m.DIVERGENCES, zone=turn.divergence_zone or "undeclared")

    def _gauges(self) -> list[tuple[MetricSpec, dict[str, str], float]]:
        """The gauges of agentkv.metrics, read from the current state (any thread)."""
        with self.lock:
            held = self._bytes_held()
            by_state = self.table.count_by_state()
            n = len(self.table)
        out: list[tuple[MetricSpec, dict[str, str], float]] = [
            (m.BYTES_HELD, {"tier": tier}, float(v)) for tier, v in held.items()
        ]
        out += [
            (m.PAUSED_TRAJECTORIES, {"state": s.value}, float(by_state.get(s.value, 0)))
            for s in sorted(PAUSED_STATES, key=lambda s: s.value)
        ]
        out.append((m.TRAJECTORIES, {}, float(n)))
        return out

    def metrics_snapshot(self) -> Snapshot:
        return self.metrics.snapshot(self._gauges())

    def _pinned_blocks(self) -> int:
        """Device blocks agentkv holds: pinned branches plus stores still reading their blocks."""
        return sum(len(b.pinned_block_ids) for _, b in self.table.branches()) + sum(
            len(j.block_ids) for j in self.jobs.values()
        )

    def _bytes_held(self) -> dict[str, int]:
        return {
            "device_pinned": self._pinned_blocks() * self.block_bytes_total,
            "host": self.index.count("host") * self.block_bytes_total,
            "disk": self.index.count("disk") * self.block_bytes_total,
        }

    def close(self) -> None:
        if self.otel is not None:
            self.otel.shutdown()

    def status(self) -> dict[str, Any]:
        host_blocks = self.index.count("host")
        disk_blocks = self.index.count("disk")
        pinned = self._pinned_blocks()
        total_blocks = (self.block_pool.num_gpu_blocks - 1) if self.block_pool is not None else 0
        return {
            "engine": {
                "pid": os.getpid(),
                "plugin_registrations": plugin.registration_count(),
                "worker_pids": {str(k): v for k, v in self.worker_pids.items()},
                "uptime_s": round(time.time() - self.started_at, 3),
            },
            "pool": {
                "usage": round(self._pool_usage(), 6),
                "total_blocks": total_blocks,
                "pinned_blocks": pinned,
                "high_water": self.settings.high_water,
                "block_size_tokens": self.block_size,
                "block_bytes": self.block_bytes_total,
            },
            "tiers": {
                "host": {
                    "blocks": host_blocks,
                    "bytes": host_blocks * self.block_bytes_total,
                    "capacity_bytes": self.host_capacity_blocks * self.block_bytes_total,
                },
                "disk": {
                    "blocks": disk_blocks,
                    "bytes": disk_blocks * self.block_bytes_total,
                    "capacity_bytes": self.disk_capacity_blocks * self.block_bytes_total,
                    "enabled": bool(self.settings.disk_dir),
                },
                "in_flight_blocks": len(self.inflight),
            },
            "bytes_held": self._bytes_held(),
            "trajectories": len(self.table),
            "trajectory_ids": [t.trajectory_id for t in self.table][:1000],
            "branches_by_state": self.table.count_by_state(),
            "decisions": dict(self.decisions),
            "prefetch": self.prefetch_outcomes.counts(),
            "counters": dict(self.counters),
            "predictor": self.predictor.tools(),
            "profile": {"source": getattr(self.profile, "source", "unknown")},
        }


def p50_or_none(p50: float) -> float | None:
    return round(p50, 6) if math.isfinite(p50) else None


def _zone_at(params: AgentKVParams, token: int) -> str | None:
    for zone in params.zones:
        if (
            zone.start_token is not None
            and zone.end_token is not None
            and zone.start_token <= token < zone.end_token
        ):
            return zone.name
    return None
