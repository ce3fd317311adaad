"""Scheduler side of AgentKVConnector: a thin adapter from vLLM's scheduler hooks to the core's
TrajectoryManager (``agentkv.manager``), which owns every state, pin, job and timer.

Primitives (engine thread, from vLLM's scheduler hooks; each returns at once for requests without
agentkv params, before any lock):
  lookup(request, num_computed)        -> (tokens the tiers hold past vLLM's own hit, async?);
                                          None tokens: ask again next step (the manager's
                                          PENDING: a remote fetch or an admission wait)
  plan_load(request, blocks, n_ext)    -> the load job for the allocated blocks
  fail_load(request, blocks, n_ext)    -> fail closed: those blocks are reported as load errors
  finish(request, block_ids)           -> (False, {"agentkv": turn stats}); with the request's
                                          ``pause_after``, or an implicit pause (its
                                          ``implicit_pause``, else the setting), the pause's
                                          answer in the stats' ``pause``
  snapshot_for_preemption()            vLLM could not allocate and may preempt: note the blocks
                                       of this connector's running requests (preemption.py: vLLM
                                       0.32 has no connector hook in _preempt_request)
  build_step()                         -> AgentKVStepMetadata (the manager's StepPlan), after
                                          handing the manager the step's admission picture
                                          (``admission_of``: O(1) counts, no queue walk) and
                                          its preempted trajectory requests (``on_preempt``:
                                          their snapshotted blocks are copied to host before
                                          this step's forward, then loaded when rescheduled)
  on_worker_report(output)             -> merged worker reports into the manager
  has_pending_work()                   -> jobs queued or in flight: keep the engine stepping
  take_events()                        -> vLLM KV events for tier copies (kv_events.py), when
                                          the server runs with --kv-events-config
Primitives (control thread): ``handle(op)`` with ops pause, resume, end, get, status, metrics,
tick (fire due timers; says whether the engine must be woken and when the next timer is due),
from the ``control_ops.ControlOps`` mixin; ``status()`` and ``metrics_snapshot()`` here.
A pause, resume or end carrying ``idempotency_key`` is applied once: a retry with the same key
(same tenant) answers the first answer again (``agentkv.idempotency.ReplayCache``).
What the side derives from vLLM's config and the settings (manager config, costs, tier sizes,
load mode) is ``engine_config``'s.

Pins use the block pool's own reference counts (``touch`` / ``free_blocks``): a pinned block can't
be evicted, and once unpinned it goes back to vLLM's prefix cache with its hash, still reusable
until vLLM needs the memory (write-back offload).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

from agentkv.admission import Admission
from agentkv.idempotency import ReplayCache
from agentkv.kv_identity import LogicalKeys
from agentkv.manager import RequestParams, TrajectoryManager
from agentkv.manager.invalidation import Invalidation, invalidate_tiers
from agentkv.manager.jobs import StepPlan
from agentkv.manager.recovery import (
    ManifestKeeper,
    load_records,
    manifest_path,
    remove_stale_manifests,
    restore,
)
from agentkv.metrics import MetricsRecorder, Snapshot
from agentkv.online_profile import OnlineProfile
from agentkv.otel_export import OTelExport
from agentkv.profile import load_profile
from agentkv.tier import LOCAL_TIERS
from agentkv_vllm import plugin
from agentkv_vllm.control_ops import REPLAYED_FIELD as REPLAYED_FIELD
from agentkv_vllm.control_ops import ControlOps
from agentkv_vllm.engine_config import (
    cost_model,
    dp_placement,
    layerwise,
    manager_config,
    policy_params,
    spec_layout,
    tier_blocks,
)
from agentkv_vllm.kv_events import TierEvents
from agentkv_vllm.kv_identity import config_weights, identity_from_config
from agentkv_vllm.metadata import AgentKVStepMetadata, AgentKVWorkerReport
from agentkv_vllm.params import (
    ENGINE_PRECEDENCE,
    AgentKVParams,
    EngineIdentity,
    IdentitySource,
    resolve_request_identity,
)
from agentkv_vllm.preemption import PreemptionNotes
from agentkv_vllm.settings import ConnectorSettings

log = logging.getLogger("agentkv.scheduler")
# A step counts as a prefill sample when it scheduled at least this many prompt tokens and they
# were most of the step (decode tokens cost far less each).
PREFILL_SAMPLE_MIN_TOKENS = 32
PREFILL_SAMPLE_MAX_S = 30.0
# The adapter's own counters, always in /status (0 until they happen).
ADAPTER_COUNTERS = (
    "malformed_params",
    "unsupported_requests",
    "load_failed_blocks",
    "step_faults",  # build_step faults: the queued jobs still went out with their step
    # Requests each engine-side source named (params.ENGINE_PRECEDENCE; explicit params include
    # those the API middleware injected from a session hint) and malformed hints per source.
    *(f"identified.{s.value}" for s in ENGINE_PRECEDENCE),
    *(f"malformed.{s.value}" for s in ENGINE_PRECEDENCE if s is not IdentitySource.PARAMS),
)
# Bounds on the adapter's per-kind warn-once set and its uni-agent lease notes.
MAX_WARNED_KINDS = 1024
MAX_LEASE_NOTES = 65536


class VllmBlockPinner:
    """The manager's BlockPinner port over vLLM's BlockPool (bound after construction)."""

    def __init__(self) -> None:
        self.pool: Any = None

    def pin(self, block_ids: Sequence[int]) -> None:
        if self.pool is not None and block_ids:
            self.pool.touch([self.pool.blocks[b] for b in block_ids])

    def unpin(self, block_ids: Sequence[int]) -> None:
        if self.pool is not None and block_ids:
            self.pool.free_blocks([self.pool.blocks[b] for b in block_ids])

    def holds(self, block_id: int, block_hash: bytes) -> bool:
        if self.pool is None:
            return False
        from vllm.v1.core.kv_cache_utils import get_block_hash

        tagged = self.pool.blocks[block_id].block_hash
        return tagged is not None and bytes(get_block_hash(tagged)) == bytes(block_hash)

    def usage(self) -> float:
        try:
            return float(self.pool.get_usage()) if self.pool is not None else 0.0
        except Exception:
            return 0.0

    def total_blocks(self) -> int:
        return max(0, int(self.pool.num_gpu_blocks) - 1) if self.pool is not None else 0


class _CpuClock:
    """Connector CPU time on the engine thread, per step and per request kind (a measured
    overhead figure instead of a noisy difference of throughputs)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: Counter[str] = Counter()

    def add(self, kind: str, start_ns: int) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + (time.thread_time_ns() - start_ns) / 1e9
        self.calls[kind] += 1

    def view(self) -> dict[str, Any]:
        return {
            kind: {"calls": self.calls[kind], "cpu_s": round(self.seconds[kind], 6)}
            for kind in sorted(self.calls)
        }


class SchedulerSide(ControlOps):
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
        # Logical keys are rank-agnostic (tp_rank -1); each worker salts them with its own rank
        # identity. The generation changes on reset_cache() and weight updates (invalidate()).
        self.weights = config_weights(model_config)
        if not self.weights.shared:
            log.warning(
                "agentkv: KV is not shared nor restored across restarts: %s", self.weights.why
            )
        self.keys = LogicalKeys(
            identity_from_config(
                vllm_config,
                num_layers=num_layers,
                layout=f"logical-v3:{spec_layout(groups)}",
                tp_rank=-1,
                block_size=self.block_size,
                weights=self.weights,
            )
        )
        host_blocks, disk_blocks = tier_blocks(settings, self.block_bytes_per_rank)
        self.metrics = MetricsRecorder()
        self.otel = OTelExport.from_env(self._gauges)
        self.metrics.sink = self.otel
        self.profile = load_profile(settings.profile_path)
        costs = cost_model(self.profile, model_config)
        self.base_costs = costs
        self.online = OnlineProfile(
            "calibrate file" if getattr(self.profile, "source", "") == "measured" else "default"
        )
        self._step_sample: tuple[float, int] | None = None
        self._step_tokens = 0
        self._step_hit_blocks = 0
        self.pinner = VllmBlockPinner()
        config = manager_config(
            settings,
            block_size=self.block_size,
            block_bytes=self.block_bytes_total,
            tp_size=self.tp_size,
            host_blocks=host_blocks,
            disk_blocks=disk_blocks,
            layerwise=layerwise(settings, vllm_config),
        )
        self.manager = TrajectoryManager(
            config,
            self.pinner,
            key_of=self._key_of,
            costs=costs,
            policy=policy_params(settings),
            metrics=self.metrics,
            otel=self.otel,
        )
        self.lock = self.manager.lock
        self.replays = ReplayCache(self.manager.clock.now)
        self.events = self._tier_events(vllm_config, host_blocks + disk_blocks)
        self._reannounce = False
        self.cpu = _CpuClock()
        self.worker_pids: dict[int, int] = {}
        self.kv_cache_manager: Any = None  # bound by the connector (bind_kv_cache_manager)
        self.preemptions = PreemptionNotes()
        # The head request the scheduler could not admit (id, first step seen), and the last
        # one admitted after waiting: /status shows how many steps a blocked queue waited.
        self._blocked: tuple[str, int] | None = None
        self.last_unblocked: dict[str, Any] | None = None
        self.counters: Counter[str] = Counter()
        # request id -> parsed params, for agentkv requests only (plain ones never enter)
        self._params: dict[str, AgentKVParams] = {}
        # request id -> where its trajectory came from (params.ENGINE_PRECEDENCE): the turn's
        # stats say it (``identified_by``)
        self._sources: dict[str, IdentitySource] = {}
        # Requests whose hints were resolved to vanilla (malformed, unsupported): resolved,
        # warned and counted once, however often a waiting request is looked up again.
        self._vanilla: set[str] = set()
        self._warned: set[str] = set()  # warn once per kind of malformed hint
        # (tenant, trajectory, branch) -> uni-agent's lease_until (unix time): caps the lease of
        # the branch's pauses; the most recent trajectories only
        self._lease_until: OrderedDict[tuple[str | None, str, str], float] = OrderedDict()
        # (request id, new blocks it needs, request, vLLM's local hit) of the request the
        # scheduler looked up last this step and has not allocated for (vLLM stops at the first
        # request it cannot allocate): not allocated by build_step, it heads a blocked queue
        self._unadmitted: tuple[str, int, Any, int] | None = None
        # Requests the scheduler looked up and has not finished (plain ones too): while any is
        # live, vLLM's loop keeps stepping, so a control op's engine work needs no wake-up
        # (``wake_needed``). Written by the engine thread only; the control thread reads it.
        self._live: set[str] = set()
        self.started_at = time.time()
        self.manifest: ManifestKeeper | None = None
        if settings.disk_dir:
            self._restore_from_disk(vllm_config)

    def _tier_events(self, vllm_config: Any, n_blocks: int) -> TierEvents | None:
        """KV events for the tier copies when the server runs with --kv-events-config (the
        manager then records its tier changes for them); None otherwise."""
        kv_events_config = getattr(vllm_config, "kv_events_config", None)
        if kv_events_config is None or not kv_events_config.enable_kv_cache_events:
            return None
        # notes for every tier copy plus the blocks of requests still running or in grace
        events = TierEvents(self.block_size, 2 * n_blocks + 8192)
        self.manager.record_tier_changes()
        return events

    @property
    def block_pool(self) -> Any:
        return self.pinner.pool

    @block_pool.setter
    def block_pool(self, pool: Any) -> None:
        self.pinner.pool = pool

    def _key_of(self, block_hash: bytes) -> bytes:
        """Tier key of one vLLM block hash: vLLM's hash already chains the prefix and carries
        cache_salt, LoRA and multimodal extras; LogicalKeys adds the KV identity and the
        generation."""
        key = self.keys.key_of(block_hash)
        if self.events is not None:
            self.events.note_key(key, bytes(block_hash))
        return key

    def _restore_from_disk(self, vllm_config: Any) -> None:
        """Restart recovery (``agentkv.manager.recovery``): the trajectories this engine's
        manifest lists under its identity and the base generation come back OFFLOADED on disk
        (the first step's plan tells the workers which files to keep: ``jobs.KeepPlan``); from
        now on the manifest follows the manager. DP rank 0 removes the manifests of DP ranks
        this deployment no longer runs (their workers' folders: ``remove_stale_rank_dirs``)."""
        dp_rank, dp_size = dp_placement(vllm_config.parallel_config)
        assert self.settings.disk_dir is not None
        if dp_rank == 0:
            for stale in remove_stale_manifests(self.settings.disk_dir, dp_size):
                log.info("agentkv: removed %s (this deployment runs %d DP ranks)", stale, dp_size)
        path = manifest_path(self.settings.disk_dir, dp_rank)
        records = load_records(
            path, self.keys.identity_digest, self.keys.generation, self.block_size
        )
        restored = restore(self.manager, records)
        if restored:
            log.info("agentkv: %d trajectory branches restored from %s", restored, path)
        self.manifest = ManifestKeeper(
            self.manager, path, lambda: (self.keys.identity_digest, self.keys.generation)
        )

    def delete_durable(self, trajectory_key: str) -> None:
        """Control thread, a DELETE answered 200 by the manager: rewrite the manifest now when
        it lists the trajectory (file I/O off the engine thread, outside the manager's lock)."""
        keeper = getattr(self, "manifest", None)  # None: no disk tier (or a bare test side)
        if keeper is not None:
            keeper.durable_delete(trajectory_key)

    def invalidate(self, reason: str) -> Invalidation:
        """A cache reset or a weight update: switch to a new generation and end every
        trajectory's KV (``agentkv.manager.invalidation``) in one critical section, so no tier
        copy written before can load. Engine thread (reset_cache, the weight-update hooks)."""
        with self.lock:
            self.keys.new_generation()
            result = invalidate_tiers(self.manager, reason)
        log.info(
            "agentkv: %s: new KV generation %s; %d trajectories ended, %d tier blocks dropped%s",
            reason,
            self.keys.generation.hex()[:12],
            result.trajectories,
            result.dropped_blocks,
            f", {result.stale_loads} loads still in flight" if result.stale_loads else "",
        )
        return result

    # ------------------------------------------------------------------ engine-thread hooks

    def _params_of(self, request: Any) -> AgentKVParams | None:
        params = self._params.get(request.request_id)
        if params is not None:
            return params
        if request.request_id in self._vanilla:
            return None
        found = resolve_request_identity(
            request.kv_transfer_params,
            getattr(request, "session_id", None),
            getattr(request, "kv_hints", None),
        )
        if found.warning:
            self._malformed(request, found)
        if found.params is None or found.source is None:
            self._vanilla.add(request.request_id)
            return None
        if getattr(request, "lora_request", None) is not None or getattr(
            request, "mm_features", None
        ):
            # Not yet validated end to end for these; serve them as vanilla vLLM does.
            with self.lock:
                self.counters["unsupported_requests"] += 1
            self._vanilla.add(request.request_id)
            return None
        with self.lock:
            self.counters[f"identified.{found.source.value}"] += 1
        self._params[request.request_id] = found.params
        self._sources[request.request_id] = found.source
        if found.lease_until is not None:
            self._note_lease(request, found)
        return found.params

    def _malformed(self, request: Any, found: EngineIdentity) -> None:
        """A malformed hint: counted (explicit params as ``malformed_params``, the others as
        ``malformed.<source>``) and logged once per kind; the request is served as vanilla."""
        source = found.source or IdentitySource.PARAMS
        name = (
            "malformed_params" if source is IdentitySource.PARAMS else f"malformed.{source.value}"
        )
        with self.lock:
            self.counters[name] += 1
        kind = found.kind or source.value
        if kind in self._warned:
            log.debug(
                "agentkv: request %s served as vanilla: %s", request.request_id, found.warning
            )
            return
        if len(self._warned) < MAX_WARNED_KINDS:
            self._warned.add(kind)
        log.warning(
            "agentkv: request %s served as vanilla: %s (logged once per kind)",
            request.request_id,
            found.warning,
        )

    def _note_lease(self, request: Any, found: EngineIdentity) -> None:
        assert found.params is not None and found.lease_until is not None
        key = (
            getattr(request, "cache_salt", None),
            found.params.trajectory_id,
            found.params.branch,
        )
        with self.lock:
            self._lease_until[key] = found.lease_until
            self._lease_until.move_to_end(key)
            while len(self._lease_until) > MAX_LEASE_NOTES:
                self._lease_until.popitem(last=False)

    def _lease_cap(
        self, tenant: str | None, trajectory_id: str, branch: str, given: float | None
    ) -> float | None:
        """``given`` (a pause's max_lease_s) capped by the branch's uni-agent lease_until."""
        with self.lock:
            until = self._lease_until.get((tenant, trajectory_id, branch))
        if until is None:
            return given
        left = max(0.0, until - time.time())
        return left if given is None else min(given, left)

    def _apply(
        self, op: object, req: dict[str, Any], tid: str, branch: str, tenant: str | None
    ) -> tuple[int, dict[str, Any]]:
        """A control op; a pause's lease is capped by the branch's ``agent_hint.lease_until``
        (an END forgets the trajectory's)."""
        if op == "pause" and self._lease_until:
            given = req.get("max_lease_s")
            cap = self._lease_cap(tenant, tid, branch, float(given) if given is not None else None)
            if cap is not None:
                req = {**req, "max_lease_s": cap}
        answer = super()._apply(op, req, tid, branch, tenant)
        if op == "end" and self._lease_until:
            with self.lock:
                for key in [k for k in self._lease_until if k[:2] == (tenant, tid)]:
                    del self._lease_until[key]
        return answer

    def lookup(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        self._live.add(request.request_id)
        # Every request the scheduler tries comes here first; allocation clears it (plan_load).
        self._unadmitted = (
            request.request_id,
            -(-request.num_tokens // self.block_size) - num_computed // self.block_size,
            request,
            num_computed,
        )
        if (
            request.kv_transfer_params is None
            and request.request_id not in self._params
            and getattr(request, "session_id", None) is None
            and getattr(request, "kv_hints", None) is None
        ):
            return 0, False
        start = time.thread_time_ns()
        try:
            params = self._params_of(request)
            if params is None:
                return 0, False
            zones = params.zones
            answer = self.manager.on_lookup(
                request.request_id,
                RequestParams(
                    params.trajectory_id,
                    params.branch,
                    zone_of=(lambda t: _zone_at(zones, t)) if zones else None,
                    tenant=getattr(request, "cache_salt", None),  # its trajectory namespace
                    prefetch=params.prefetch,
                    arrived_at=self._arrived_at(request),
                ),
                request.prompt_token_ids or [],
                request.block_hashes,
                num_computed,
                num_tokens=request.num_tokens,  # a preempted request's output counts too
            )
            self.preemptions.hold(request)
            if answer.tokens is None:
                self._unadmitted = None  # our own PENDING, not a lack of blocks
            return answer.tokens, answer.load_async
        finally:
            self.cpu.add("request", start)

    def _arrived_at(self, request: Any) -> float | None:
        """vLLM's ``arrival_time`` (wall clock, stamped by the API server when the request came
        in) on the manager's clock: a request queued before a DELETE is told apart from one
        sent after its 200 (``RequestTable.mark_deleted``). None when vLLM gives none."""
        arrival = getattr(request, "arrival_time", None)
        if not isinstance(arrival, int | float):
            return None
        return self.manager.clock.now() - max(0.0, time.time() - float(arrival))

    def plan_load(self, request: Any, blocks: Any, num_external: int) -> None:
        if self._unadmitted is not None and self._unadmitted[0] == request.request_id:
            self._unadmitted = None
        if self._blocked is not None and self._blocked[0] == request.request_id:
            self.last_unblocked = {
                "request_id": request.request_id,
                "blocked_at_step": self._blocked[1],
                "admitted_at_step": self.manager.steps + 1,  # the step being scheduled
            }
            self._blocked = None
        if request.request_id not in self._params and num_external <= 0:
            return
        start = time.thread_time_ns()
        try:
            self.manager.on_alloc(request.request_id, blocks.get_block_ids()[0], num_external)
        finally:
            self.cpu.add("request", start)

    def fail_load(self, request: Any, blocks: Any, num_external: int) -> None:
        self.manager.fail_load(request.request_id, blocks.get_block_ids()[0], num_external)

    def finish(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._live.discard(request.request_id)
        self.preemptions.drop(request.request_id)
        self._vanilla.discard(request.request_id)
        params = self._params.pop(request.request_id, None)
        source = self._sources.pop(request.request_id, None)
        if params is None:
            return False, None
        start = time.thread_time_ns()
        try:
            from vllm.v1.request import RequestStatus

            if self.events is not None:
                self.events.note_blocks(
                    request.block_hashes, request.all_token_ids, session_id=params.trajectory_id
                )

            computed = max(
                0, request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
            )
            aborted = request.status == RequestStatus.FINISHED_ABORTED
            stats = self.manager.on_finish(
                request.request_id,
                block_ids,
                computed_tokens=computed,
                token_ids=request.all_token_ids,
                block_hashes=request.block_hashes,
                aborted=aborted,
            )
            if stats is not None and source is not None:
                stats = {**stats, "identified_by": source.value}
            if stats is not None and params.pause_after is not None and not aborted:
                stats = {**stats, "pause": self._pause_after(request, params)}
            elif stats is not None and not aborted and self._implicit_pause(params):
                stats = {**stats, "pause": self._pause_finished(request, params)}
            return False, ({"agentkv": stats} if stats is not None else None)
        finally:
            self.cpu.add("request", start)

    def _pause_after(self, request: Any, params: AgentKVParams) -> dict[str, Any]:
        """The request's ``pause_after``, applied as the pause route would, now that its turn
        is recorded (the decision sees this turn's context). The answer goes back in the
        response's ``kv_transfer_params.agentkv.pause``: the decision, or the error."""
        spec = params.pause_after
        assert spec is not None
        code, reply = self.manager.pause(
            params.trajectory_id,
            params.branch,
            spec.tool_names,
            spec.expected_wait_s,
            max_lease_s=self._lease_cap(
                getattr(request, "cache_salt", None),
                params.trajectory_id,
                params.branch,
                spec.max_lease_s,
            ),
            tenant=getattr(request, "cache_salt", None),
        )
        self.counters["request_pauses" if code == 200 else "request_pause_failures"] += 1
        return reply if code == 200 else {"status": code, **reply}

    def _implicit_pause(self, params: AgentKVParams) -> bool:
        """The request's ``implicit_pause``, else the connector's setting."""
        own = params.implicit_pause
        return self.settings.implicit_pause if own is None else own

    def _pause_finished(self, request: Any, params: AgentKVParams) -> dict[str, Any]:
        """The implicit pause of the finished turn (``TrajectoryManager.pause_finished``): the
        decision, the reason it was skipped, or the error, in the response's
        ``kv_transfer_params.agentkv.pause`` as ``pause_after``'s."""
        tenant = getattr(request, "cache_salt", None)
        return self.manager.pause_finished(
            params.trajectory_id,
            params.branch,
            params.pause_env,
            max_lease_s=self._lease_cap(tenant, params.trajectory_id, params.branch, None),
            tenant=tenant,
        )

    def snapshot_for_preemption(self) -> None:
        start = time.thread_time_ns()
        try:
            self.preemptions.note(self.kv_cache_manager, self.block_size)
        finally:
            self.cpu.add("step", start)

    def _save_preempted(self, scheduler_output: Any) -> None:
        """This step's preempted trajectory requests: their noted blocks go to host before the
        forward (``TrajectoryManager.on_preempt``)."""
        for req_id, ids, computed, hashes in self.preemptions.take(scheduler_output):
            self.manager.on_preempt(req_id, ids, computed_tokens=computed, block_hashes=hashes)

    def build_step(self, scheduler_output: Any = None) -> AgentKVStepMetadata:
        """The step's jobs. A fault in the parts before ``take_step`` (the step sample, the
        preemption saves, the admission picture, the KV events) still ships the manager's
        outbox with this step: its layerwise loads run in this step's forward and its
        preemption saves read blocks vLLM may reallocate next step, so a later step is wrong
        KV, not a delay. The parts' work is lost for the step (counted ``step_faults``)."""
        start = time.thread_time_ns()
        try:
            try:
                self._sample_step(scheduler_output)  # before admission_of: this step's fill
                self._save_preempted(scheduler_output)
                admission = self.admission_of(scheduler_output)
                if self.events is None and self.manager.idle_step(admission):
                    return AgentKVStepMetadata(StepPlan())  # plain traffic: nothing to plan
                self.manager.set_admission(admission)
                if self.events is not None:
                    self._watch_cache_reset()
            except Exception:
                log.exception("agentkv: preparing the step failed; its queued jobs still go out")
                with self.lock:
                    self.counters["step_faults"] += 1
            return AgentKVStepMetadata(self._take_step())
        finally:
            self.cpu.add("step", start)

    def _take_step(self) -> StepPlan:
        """``take_step``, or, should it raise past its own guard, the outbox as it stands: the
        jobs already promised to vLLM go out with this step either way."""
        try:
            return self.manager.take_step()
        except Exception:
            log.exception("agentkv: the manager's step failed; its queued jobs still go out")
            with self.lock:
                self.counters["step_faults"] += 1
            with self.manager.lock:
                plan, self.manager.outbox = self.manager.outbox, StepPlan()
            return plan

    def admission_of(self, scheduler_output: Any) -> Admission:
        """This step's admission picture, from counts the hooks already hold: the request vLLM
        looked up and could not allocate for (it stops the waiting queue there), the requests it
        preempted, the pool's free blocks. Resets the looked-up request for the next step."""
        head, self._unadmitted = self._unadmitted, None
        if head is not None and (self._blocked is None or self._blocked[0] != head[0]):
            self._blocked = (head[0], self.manager.steps + 1)  # this step's take_step is next
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
        free = 0
        pool = self.block_pool
        if pool is not None:
            try:
                free = int(pool.get_num_free_blocks())
            except Exception:
                free = 0
        return Admission(
            waiting=1 if head is not None else 0,
            blocks_needed=max(0, head[1]) + self._free_hits(head[2], head[3]) if head else 0,
            free_blocks=free,
            preempted=len(preempted),
            filled_blocks=self._step_tokens / max(1, self.block_size),
            hit_blocks=self._step_hit_blocks,
        )

    def _free_hits(self, request: Any, num_computed: int) -> int:
        """Blocks of the head request's prefix-cache hit that sit unreferenced in the free list:
        allocating takes them off it too (vLLM's allocate_slots counts them against the free
        blocks), so they are part of what the queue needs. O(hit blocks), the head only."""
        pool = self.block_pool
        n = num_computed // self.block_size
        if pool is None or n <= 0:
            return 0
        free = 0
        try:
            for block_hash in list(getattr(request, "block_hashes", ()) or ())[:n]:
                blocks = pool.get_cached_block(block_hash, [0])
                if blocks and blocks[0].ref_cnt == 0:
                    free += 1
        except Exception:
            return 0
        return free

    def _watch_cache_reset(self) -> None:
        """vLLM queues AllBlocksCleared when its prefix cache is reset; consumers then forget this
        engine's blocks, tier copies included, so take_events announces them again. The queue
        is drained after this step's schedule, so it is still visible here."""
        queue = getattr(self.block_pool, "kv_event_queue", None)
        if queue and any(type(e).__name__ == "AllBlocksCleared" for e in queue):
            self._reannounce = True

    def take_events(self) -> list[Any]:
        if self.events is None:
            return []
        start = time.thread_time_ns()
        try:
            out = self.events.events(self.manager.take_tier_changes())
            if self._reannounce:
                self._reannounce = False
                out.extend(
                    self.events.reannounce(
                        {tier: self.manager.tier_keys(tier) for tier in LOCAL_TIERS}
                    )
                )
            return out
        except Exception:
            # Events inform routers; a bug here must never stop the engine.
            log.exception("agentkv: KV events for the tiers failed; dropped this batch")
            return []
        finally:
            self.cpu.add("step", start)

    def _sample_step(self, scheduler_output: Any) -> None:
        """Online prefill rate: a step mostly made of prompt tokens, timed from its metadata to
        its output (or to the next step when vLLM reports no connector output)."""
        self._end_step_sample()
        self._step_tokens = 0
        self._step_hit_blocks = 0
        per_req = getattr(scheduler_output, "num_scheduled_tokens", None)
        if not per_req:
            return
        total = sum(per_req.values())
        self._step_tokens = total  # the KV this step writes (the pool's fill, admission_of)
        # A request scheduled for the first time also takes its prefix-cache hit out of the
        # free queue (vLLM's touch): that moves the freed blocks behind the hit closer to
        # eviction. Without it the forecast ran late and deferred write-backs lost contexts
        # (issue 26; the simulator found it). The trend counts hits apart from new KV (a hit
        # moves only what is behind it: PoolTrend), and the manager keeps the contexts ahead
        # of a placed context's resume in place (DeferredWritebacks._resumed). Counting hits
        # that running requests already held overstates them: the forecast errs early,
        # towards a copy nobody reads, never towards a lost context.
        self._step_hit_blocks = sum(
            int(getattr(r, "num_computed_tokens", 0) or 0) // max(1, self.block_size)
            for r in getattr(scheduler_output, "scheduled_new_reqs", None) or ()
        )
        prefill = sum(n for n in per_req.values() if n > 1)
        if prefill >= PREFILL_SAMPLE_MIN_TOKENS and prefill >= 0.8 * total:
            self._step_sample = (time.perf_counter(), total)

    def _end_step_sample(self) -> None:
        sample, self._step_sample = self._step_sample, None
        if sample is None:
            return
        seconds = time.perf_counter() - sample[0]
        if 0 < seconds < PREFILL_SAMPLE_MAX_S:
            self.online.observe_prefill(sample[1], seconds)
            self._refresh_costs()

    def _refresh_costs(self) -> None:
        costs = self.online.costs(self.base_costs)
        with self.lock:
            self.manager.costs = costs

    def on_worker_report(self, output: Any) -> None:
        meta = getattr(output, "kv_connector_worker_meta", None)
        invalid = getattr(output, "invalid_block_ids", None)
        if not isinstance(meta, AgentKVWorkerReport) and not invalid:
            return
        start = time.thread_time_ns()
        try:
            self._end_step_sample()
            if isinstance(meta, AgentKVWorkerReport):
                self.worker_pids.update(meta.report.hello)
                for (kind, tier, _), (nbytes, seconds) in meta.report.transfers.items():
                    self.online.observe_transfer(kind, tier, nbytes, seconds)
                if meta.report.transfers:
                    self._refresh_costs()
                self.manager.on_report(meta.report)
            if invalid:
                with self.lock:
                    self.counters["load_failed_blocks"] += len(invalid)
        finally:
            self.cpu.add("step", start)

    def has_pending_work(self) -> bool:
        return self.manager.has_work()

    def wake_needed(self) -> bool:
        """Control thread, after an op: whether vLLM's loop may be blocked waiting for requests
        while the op left work only a step applies (jobs, pin changes). Race-free when it says
        no: the op queued its work before this read, and a loop with a live request steps
        again, then asks ``has_pending_work`` (which sees that work) before it blocks."""
        return not self._live and self.manager.engine_work_pending()

    # ------------------------------------------------------------------ control ops

    def _gauges(self) -> list[Any]:
        return self.manager.gauges() if hasattr(self, "manager") else []

    def metrics_snapshot(self) -> Snapshot:
        return self.metrics.snapshot(self._gauges())

    def close(self) -> None:
        if self.manifest is not None:
            self.manifest.close()
        if self.otel is not None:
            self.otel.shutdown()

    def status(self) -> dict[str, Any]:
        body = self.manager.status()
        with self.lock:
            counters = dict.fromkeys(ADAPTER_COUNTERS, 0)
            counters.update(body["counters"])
            for name, n in self.counters.items():
                counters[name] = counters.get(name, 0) + n
            body["counters"] = counters
            body["engine"] = {
                "pid": os.getpid(),
                "plugin_registrations": plugin.registration_count(),
                "worker_pids": {str(k): v for k, v in self.worker_pids.items()},
                "uptime_s": round(time.time() - self.started_at, 3),
                "tp_size": self.tp_size,
                "kv_identity": self.keys.identity_digest.hex(),
                "kv_generation": self.keys.generation.hex(),
                # Requests looked up and not finished: while any is, control ops do not wake
                # the engine loop (``wake_needed``).
                "live_requests": len(self._live),
            }
            # Whether tier copies are shared with other replicas and restarts (issue 40).
            body["identity"] = {
                "weights": self.weights.name,
                "shared": self.weights.shared,
                "why": self.weights.why or None,
            }
            body["connector_cpu"] = self.cpu.view()
            body["pool"]["last_unblocked"] = self.last_unblocked
            body["profile"] = {
                "source": getattr(self.profile, "source", "unknown"),
                "live": self.online.view(self.base_costs),
            }
        return body


def _zone_at(zones: Sequence[Any], token: int) -> str | None:
    for zone in zones:
        if (
            zone.start_token is not None
            and zone.end_token is not None
            and zone.start_token <= token < zone.end_token
        ):
            return str(zone.name)
    return None
