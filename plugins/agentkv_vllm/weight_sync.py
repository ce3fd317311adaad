"""Weight updates reach the connector: every tier copy older than the weights becomes unloadable.

vLLM 0.32 changes weights through worker RPCs (``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``, the dev ``/collective_rpc`` ``reload_weights``, ``/weight_checker``
reset) and names them with ``/update_weight_version`` (or ``finish_weight_update``'s
``weight_version``); no connector hook sees either. RL trainers add their own worker methods
(verl ``update_weights_from_ipc``, SkyRL ``update_weights_ipc``, OpenRLHF ``update_weight``,
AReaL ``areal_update_weights...``, through ``--worker-extension-cls``). All of them pass through
the engine core (``EngineCore.collective_rpc`` and ``EngineCore.set_weight_version``), in the
process and on the thread of the scheduler's connector, so ``install`` wraps those two methods:

  - an RPC is taken to change the weights unless its method is on the read-only allowlist
    (``READ_ONLY_RPCS`` plus the connector's ``readonly_rpcs`` setting): a weight change is
    detected by what the RPC may do, not by its name, because every trainer names its own.
    Such an RPC invalidates before it runs (nothing older loads while the weights change) and
    again after it returns or fails (KV computed during the change mixes weights). A callable
    (``collective_rpc(fn)``) is never on the allowlist;
  - a new weight version invalidates after it is set.

A prefix-cache reset that includes the connector (``reset_prefix_cache?reset_external=true``,
vLLM's pause or sleep with clear_cache) invalidates *before* vLLM resets its own block pool
(``Scheduler.reset_prefix_cache`` is wrapped too): agentkv's device pins (trajectories held or
retained) are released first, so vLLM's reset is not refused for blocks agentkv holds; the
connector's ``reset_cache`` then reports whether anything stale can still load. With the
connector's ``reset_invalidates_tiers`` setting on, a plain ``reset_prefix_cache()`` (what
OpenRLHF, ROLL and SkyRL call after their syncs) invalidates the tiers too. Otherwise a plain
reset (``POST /reset_prefix_cache``) runs through ``AgentKVConnector.agentkv_prefix_cache_reset``:
tier copies stay, and a paused context whose host copy was deferred (``cached``, its blocks only
in vLLM's prefix cache) is copied to host from the blocks the reset unhashed, instead of being
lost while its branch still says ``cached`` (agentkv/manager/writeback.py).

Invalidation is ``AgentKVConnector.agentkv_weights_changed`` (a new KV generation and every
trajectory ended). Independent of whether the trainer also resets the prefix cache. Engines
without agentkv pass through untouched; a failure in the hook is logged and never fails the call.

Primitives:
    READ_ONLY_RPCS     worker methods known to leave the weights alone (vLLM's own)
    changes_weights(method, readonly)   False only for a named method on either allowlist
    install()          wrap the engine core once (idempotent; vLLM runs general plugins in
                       every process)
    notify(core, why)  tell the core's connector, if it is agentkv's
    notify_scheduler(scheduler, why)  the same from the scheduler
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger("agentkv.weight_sync")

# vLLM 0.32's own worker RPCs that never change what the weights compute (read from
# vllm/v1/engine, vllm/entrypoints and vllm/v1/worker): queries, health, cache housekeeping
# outside the KV pool, LoRA bookkeeping (a LoRA is part of every block hash already) and the
# weight-transfer engine's setup and teardown (the transfer itself is ``update_weights``).
READ_ONLY_RPCS = frozenset(
    {
        "check_health",
        "compute_weight_checksums",
        "determine_available_memory",
        "execute_dummy_batch",
        "get_encoder_timing_stats",
        "get_kv_cache_spec",
        "get_kv_connector_handshake_metadata",
        "get_model_inspection",
        "get_supported_kv_cache_layouts",
        "get_supported_tasks",
        "init_weight_transfer_engine",
        "list_loras",
        "add_lora",
        "remove_lora",
        "pin_lora",
        "profile",
        "release_late_interaction_query_cache",
        "reset_encoder_cache",
        "reset_mm_cache",
        "shutdown_weight_transfer_engine",
        "synchronize_device",
        "take_draft_token_ids",
        "update_max_model_len",
    }
)
_MARK = "_agentkv_weight_sync"


def notify(core: Any, reason: str) -> None:
    """Invalidate the tiers of ``core``'s connector when it is agentkv's; never raises."""
    notify_scheduler(getattr(core, "scheduler", None), reason)


def _method_name(method: Any) -> str:
    return method if isinstance(method, str) else str(getattr(method, "__name__", "<callable>"))


def changes_weights(method: Any, readonly: frozenset[str] | set[str] = frozenset()) -> bool:
    """Whether a ``collective_rpc`` of ``method`` may change the weights: True unless it names a
    method on ``READ_ONLY_RPCS`` or ``readonly`` (a callable runs arbitrary code: True)."""
    if not isinstance(method, str):
        return True
    return method not in READ_ONLY_RPCS and method not in readonly


def _settings(scheduler: Any) -> Any:
    """The agentkv connector's settings of ``scheduler``, or None (another or no connector)."""
    connector = getattr(scheduler, "connector", None)
    if getattr(connector, "agentkv_weights_changed", None) is None:
        return None
    return getattr(connector, "settings", None)


def _readonly(core: Any) -> frozenset[str]:
    settings = _settings(getattr(core, "scheduler", None))
    return frozenset(getattr(settings, "readonly_rpcs", None) or ())


def install() -> bool:
    """Wrap ``EngineCore.collective_rpc`` and ``set_weight_version``; False when vLLM lacks them."""
    try:
        from vllm.v1.engine.core import EngineCore
    except Exception:  # another vLLM layout: nothing to hook
        return False
    if getattr(EngineCore, _MARK, False):
        return True
    rpc = getattr(EngineCore, "collective_rpc", None)
    set_version = getattr(EngineCore, "set_weight_version", None)
    if rpc is None or set_version is None:
        log.warning("agentkv: this vLLM has no weight-update entry points to watch")
        return False

    @functools.wraps(rpc)
    def collective_rpc(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        if not changes_weights(method, _readonly(self)):
            return rpc(self, method, *args, **kwargs)
        name = _method_name(method)
        notify(self, f"weights_{name}")
        try:
            return rpc(self, method, *args, **kwargs)
        finally:
            notify(self, f"weights_{name}")

    @functools.wraps(set_version)
    def set_weight_version(self: Any, weight_version: str) -> Any:
        result = set_version(self, weight_version)
        notify(self, "weight_version")
        return result

    _wrap_reset()
    EngineCore.collective_rpc = collective_rpc  # type: ignore[method-assign]
    EngineCore.set_weight_version = set_weight_version  # type: ignore[method-assign]
    setattr(EngineCore, _MARK, True)
    return True


def _wrap_reset() -> None:
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except Exception:
        return
    reset = getattr(Scheduler, "reset_prefix_cache", None)
    if reset is None:
        return

    @functools.wraps(reset)
    def reset_prefix_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        reset_connector = kwargs.get("reset_connector", args[1] if len(args) > 1 else False)
        if reset_connector or getattr(_settings(self), "reset_invalidates_tiers", False):
            notify_scheduler(self, "reset")
            return reset(self, *args, **kwargs)
        keep = getattr(getattr(self, "connector", None), "agentkv_prefix_cache_reset", None)
        if keep is None:
            return reset(self, *args, **kwargs)
        return keep(lambda: reset(self, *args, **kwargs))

    Scheduler.reset_prefix_cache = reset_prefix_cache  # type: ignore[method-assign]


def notify_scheduler(scheduler: Any, reason: str) -> None:
    """Invalidate ``scheduler``'s connector's tiers when it is agentkv's; never raises."""
    try:
        hook = getattr(getattr(scheduler, "connector", None), "agentkv_weights_changed", None)
        if hook is not None:
            hook(reason)
    except Exception:
        log.exception("agentkv: invalidation before a cache reset failed")
