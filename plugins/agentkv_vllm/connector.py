"""AgentKVConnector: vLLM's KVConnectorBase_V1 for agent trajectories.

vLLM creates one instance per role: SCHEDULER (in the engine core) delegates to
``SchedulerSide`` (a thin adapter over the core's TrajectoryManager); WORKER (in each worker
process) delegates to ``WorkerSide``. Requests without ``kv_transfer_params.agentkv`` pass through
untouched, so the engine behaves exactly like vanilla vLLM for them.

Fail closed: no hook lets an agentkv fault escape into the engine, and once a lookup made vLLM
count external tokens, any later fault reports those blocks as load errors
(``get_block_ids_with_load_errors``), so vLLM recomputes them: never unwritten KV, never a hang.
Pipeline parallelism is refused at start (blocks would span stages); the TP rank comes from
vLLM's parallel state or start-up fails.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from agentkv.manager.jobs import BlockTransfer, LoadJob, StepPlan
from agentkv_vllm.metadata import AgentKVStepMetadata
from agentkv_vllm.settings import ConnectorSettings, base_engine_id

if TYPE_CHECKING:
    from agentkv_vllm.scheduler_side import SchedulerSide
    from agentkv_vllm.worker_side import WorkerSide

log = logging.getLogger("agentkv.connector")


class AgentKVConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.settings = ConnectorSettings.model_validate(extra)
        pp = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
        if pp > 1:
            raise ValueError(
                f"agentkv: pipeline_parallel_size={pp} is not supported (a trajectory's KV blocks "
                "would span pipeline stages); use tensor parallelism or disable the connector"
            )
        self._scheduler: SchedulerSide | None = None
        # Failing loads queued when the manager itself could not (last line of fail-closed).
        self._emergency_loads: list[LoadJob] = []
        self._worker: WorkerSide | None = None
        self._control: Any = None
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning(
                'agentkv: kv_load_failure_policy is %r; set it to "recompute" in --kv-transfer-config '
                "so a tier fault costs a recompute instead of failing the request",
                self._kv_transfer_config.kv_load_failure_policy,
            )
        if role == KVConnectorRole.SCHEDULER:
            from agentkv_vllm.control import ControlServer
            from agentkv_vllm.scheduler_side import SchedulerSide

            self._scheduler = SchedulerSide(vllm_config, kv_cache_config, self.settings)
            from agentkv_vllm.engine_config import dp_placement

            dp_rank = dp_placement(vllm_config.parallel_config)[0]  # dense DP: not the rank field
            endpoint = self.settings.control_endpoint(
                base_engine_id(self._kv_transfer_config.engine_id, dp_rank), dp_rank
            )
            try:
                self._control = ControlServer(endpoint, self._scheduler.handle)
                log.info("agentkv: control channel on %s", endpoint)
            except Exception as exc:
                log.warning(
                    "agentkv: control channel %s unavailable (%s); routes will answer 503",
                    endpoint,
                    exc,
                )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from agentkv_vllm.worker_side import WorkerSide

            try:
                rank = int(get_tensor_model_parallel_rank())
            except Exception as exc:
                # A wrong rank would mix shards between ranks: refuse to start instead.
                raise RuntimeError(
                    f"agentkv: cannot read this worker's tensor-parallel rank from vLLM ({exc})"
                ) from exc
            from agentkv_vllm.engine_config import dp_placement
            from agentkv_vllm.kv_identity import identity_from_config

            dp_rank, dp_size = dp_placement(vllm_config.parallel_config)
            self._worker = WorkerSide(
                settings=self.settings,
                model_id=str(vllm_config.model_config.model),
                identity=identity_from_config(vllm_config, num_layers=0, layout="", tp_rank=rank),
                tp_rank=rank,
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                num_blocks=kv_cache_config.num_blocks if kv_cache_config is not None else 0,
                dp_rank=dp_rank,
                dp_size=dp_size,
            )

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        if not self._worker.num_blocks:
            first = next(iter(kv_caches.values()))
            self._worker.num_blocks = int(first.shape[0])
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Worker, each step before the forward: start the step's jobs. Must not block; a fault
        fails every job the step had not started (``WorkerSide.fail_step``): the loads' blocks
        are reported as load errors, async loads as finished, every job to the manager as
        failed (it releases their pins).

        A step with no job binds nothing: vLLM's attention layers call ``wait_for_layer_load``
        and ``save_kv_layer`` only while ``has_connector_metadata()`` (kv_transfer_utils), so
        such a step skips the connector in every layer. Safe because layerwise loads start and
        finish within their own step: with no load in this plan, no layer has anything to wait
        for."""
        if isinstance(connector_metadata, AgentKVStepMetadata) and not connector_metadata.plan:
            self._connector_metadata = None
            return
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, AgentKVStepMetadata):
            try:
                self._worker.start_step(connector_metadata)  # fails its own loads on a fault
            except Exception:
                log.exception("agentkv: worker step failed; affected requests recompute")
                try:
                    self._worker.fail_step(connector_metadata.plan)
                except Exception:
                    log.exception("agentkv: failing the step's loads failed")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # Loads were submitted at bind time: async ones complete in the background (their requests
        # wait in WAITING_FOR_REMOTE_KVS until get_finished reports them), layerwise ones are
        # being copied by the layer copier; nothing here has to block.
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker, before each attention layer: block until this step's layerwise loads have
        copied ``layer_name`` (bounded; on timeout the blocks are reported as load errors)."""
        if self._worker is not None:
            try:
                self._worker.wait_for_layer(layer_name)  # fails the step's loads on a fault
            except Exception:
                log.exception("agentkv: waiting for layer %s failed", layer_name)
                try:
                    self._worker.fail_layerwise()
                except Exception:
                    log.exception("agentkv: failing the step's layerwise loads failed")

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Stores happen on finished (paused) trajectories from their pinned blocks, not per layer.
        return

    def wait_for_save(self) -> None:
        self._finish_step()

    def _finish_step(self) -> None:
        if self._worker is not None:
            try:
                self._worker.finish_step()
            except Exception:
                log.exception("agentkv: finishing the layer copier failed")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker, each step: request ids whose async loads are done (ok or failed; failures are
        in ``get_block_ids_with_load_errors``). Never ``finished_sending``: agentkv stores from
        its own pins, never from a finishing request's blocks."""
        if self._worker is None:
            return None, None
        self._finish_step()  # also here: vLLM skips wait_for_save in some steps
        try:
            recving = self._worker.poll()
        except Exception:
            log.exception("agentkv: polling transfers failed")
            recving = set()
        return None, (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_error_block_ids() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        try:
            return self._worker.take_report()
        except Exception:  # the report stays with the worker: the next step carries it
            log.exception("agentkv: building the worker report failed")
            return None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._control is not None:
            self._control.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # ------------------------------------------------------------------ scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.block_pool = gpu_block_pool

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.kv_cache_manager = kv_cache_manager

    def has_pending_block_frees(self) -> bool:
        """Scheduler: vLLM failed an allocation and asks before preempting (scheduler.py:790,
        the only connector call ahead of ``_preempt_request``, which frees the victim's blocks
        with no connector hook). agentkv notes its running requests' blocks here so the
        preempted ones can be saved to host in this step's metadata; it never stalls the
        scheduler (False: preempt as vanilla vLLM would). Never raises."""
        if self._scheduler is not None:
            try:
                self._scheduler.snapshot_for_preemption()
            except Exception:
                log.exception("agentkv: noting blocks before a preemption failed")
        return False

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Scheduler: tokens past vLLM's own prefix hit that a tier holds (0 on any fault: the
        safe answer before vLLM counted anything), and whether they load asynchronously. None asks
        again next step (admission wait). Plain requests return at once."""
        assert self._scheduler is not None
        try:
            return self._scheduler.lookup(request, num_computed_tokens)
        except Exception:
            log.exception("agentkv: lookup failed for %s; serving by recompute", request.request_id)
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Scheduler: vLLM counted ``num_external_tokens``; after this, every one of them is
        covered by a load job or reported failed (fail closed)."""
        assert self._scheduler is not None
        try:
            self._scheduler.plan_load(request, blocks, num_external_tokens)
        except Exception:
            log.exception("agentkv: load planning failed for %s; recomputing", request.request_id)
            if num_external_tokens <= 0:
                return
            try:
                self._scheduler.fail_load(request, blocks, num_external_tokens)
            except Exception:
                log.exception("agentkv: failing the load of %s", request.request_id)
                self._emergency_fail(request, blocks, num_external_tokens)

    def _emergency_fail(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Every allocated block past the local hit fails to load: vLLM recomputes them."""
        try:
            ids = list(blocks.get_block_ids()[0])
        except Exception:
            log.exception("agentkv: cannot read the blocks of %s", request.request_id)
            return
        self._emergency_loads.append(
            LoadJob(0, request.request_id, [BlockTransfer(b"", b) for b in ids])
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Scheduler, each step: the step's jobs. Never raises; loads already promised to vLLM
        always go out (the manager's outbox survives a fault in its timers)."""
        assert self._scheduler is not None
        try:
            meta = self._scheduler.build_step(scheduler_output)
        except Exception:
            log.exception("agentkv: building step metadata failed")
            meta = AgentKVStepMetadata(StepPlan())
        if self._emergency_loads:
            meta.plan.loads.extend(self._emergency_loads)
            self._emergency_loads = []
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is None:
            return
        try:
            self._scheduler.on_worker_report(connector_output)
        except Exception:
            log.exception("agentkv: processing worker report failed")

    def take_events(self) -> Iterable[Any]:
        """Scheduler, after each step's output: KV events (BlockStored/BlockRemoved, medium CPU
        or STORAGE) for agentkv's tier copies; empty unless --kv-events-config enables events.
        Never raises."""
        if self._scheduler is None:
            return ()
        return self._scheduler.take_events()

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, once per request before its blocks are freed: pin what the trajectory keeps
        (only KV that was fully computed or loaded) and return the turn's stats. Never delays
        vLLM's free (False): agentkv holds its own references."""
        assert self._scheduler is not None
        try:
            return self._scheduler.finish(request, block_ids)
        except Exception:
            log.exception("agentkv: request_finished failed for %s", request.request_id)
            return False, None

    def reset_cache(self) -> bool | None:
        """Scheduler: an external cache reset (``POST /reset_prefix_cache?reset_external=true``,
        vLLM's pause or sleep with clear_cache). Every tier copy becomes unloadable at once: a
        new KV generation (host and disk copies dropped, remote copies fenced: their names are
        never derived again) and every trajectory ended as DELETE ends it. True only when
        nothing stale can load: False while a load looked up before the reset is still in
        flight (call again). A plain prefix-cache reset never calls this: tier copies stay.
        The worker role answers None (nothing of its own to reset)."""
        if self._scheduler is None:
            return None
        try:
            return self._scheduler.invalidate("reset").clean
        except Exception:
            log.exception("agentkv: cache reset failed")
            return False

    def agentkv_prefix_cache_reset(self, reset: Callable[[], Any]) -> Any:
        """Scheduler: run vLLM's plain prefix-cache reset (``weight_sync`` wraps
        ``Scheduler.reset_prefix_cache``) so that paused contexts whose host copy was deferred
        are copied, not lost: see ``TrajectoryManager.prefix_cache_reset``. Returns the reset's
        answer; agentkv's faults never fail it (vLLM's own errors pass through)."""
        if self._scheduler is None:
            return reset()
        return self._scheduler.manager.prefix_cache_reset(reset)

    def agentkv_weights_changed(self, reason: str) -> None:
        """Scheduler: the weights changed or are changing (``weight_sync`` hooks vLLM's weight
        update calls): every older tier copy becomes unloadable, as for ``reset_cache``. Never
        raises: a weight update must not fail because of agentkv."""
        if self._scheduler is None:
            return
        try:
            self._scheduler.invalidate(reason)
        except Exception:
            log.exception("agentkv: invalidating the tiers after %s failed", reason)

    def has_pending_push_work(self) -> bool:
        """Scheduler: keep the engine stepping while jobs are queued or in flight (their reports
        arrive only with steps). Idle timers are woken by the routes' pump, not by stepping."""
        if self._scheduler is None:
            return False
        if self._emergency_loads:
            return True
        try:
            return self._scheduler.has_pending_work()
        except Exception:
            return False
