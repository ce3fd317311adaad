"""agentkv for in-process engines: an RL rollout that drives vLLM's ``AsyncLLM`` itself (verl,
OpenRLHF, ROLL) gets the per-request params, the turn's prefix stats and the trajectory ops
(pause, resume, end, get, status) without an API server.

Primitives:
  trajectory_params(trajectory_id, branch="main", *, pause_after=None, zones=None,
                    implicit_pause=None, env=None) -> dict
      the ``kv_transfer_params`` value ``{"agentkv": {...}}`` (validated here: a bad id raises
      ValueError at the caller, not a vanilla request later). verl 0.9.1 takes it as is:
      ``server.generate(..., kv_transfer_params=...)`` is merged into
      ``SamplingParams.extra_args["kv_transfer_params"]``
      (``workers/rollout/vllm_rollout/vllm_async_server.py`` ~629-632).
  extra_args(trajectory_id, ..., extra=None) -> dict
      ``SamplingParams(extra_args=...)`` for callers that build their own SamplingParams
      (OpenRLHF, ROLL): ``extra`` (their own extra_args, another connector's
      ``kv_transfer_params`` keys included) with the agentkv params merged in.
  turn_stats(output) -> dict | None
      the turn's agentkv stats of a finished ``RequestOutput``: vLLM puts the connector's
      reply in ``RequestOutput.kv_transfer_params`` (the HTTP routes return the same object).
  InProcessAgentKV(engine)      ``async with InProcessAgentKV(engine) as kv:`` the control ops
      over the engine's control channel (``control.ControlClient``, the channel the HTTP routes
      use) and the timer pump (``pump.timer_pump``, with ``prefetch_issuer.PrefetchIssuer``)

Why the pump: vLLM's engine loop sleeps while no request is queued, and agentkv's timers (the
grace after a turn, leases, deferred write-backs, prefetches, job timeouts) fire only inside an
engine step or on a control ``tick``. Under ``vllm serve`` the routes plugin runs that tick
loop; an in-process ``AsyncLLM`` has no API server, so without ``InProcessAgentKV`` a
trajectory's timers stop between two turns, exactly while its environment step runs (a lease
outlives its end, a prefetch never starts, a finished turn waits for the next request to take
its default action). ``InProcessAgentKV`` starts the same pump on the caller's event loop.

A pause or resume wakes the engine loop when the engine says it needs it (``WAKE_FIELD``: the
offload the pause queued runs at the next step, and an idle loop has none), as the routes do.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from agentkv.idempotency import KEY_FIELD
from agentkv.ids import TENANT_FIELD
from agentkv_vllm.control import ControlClient
from agentkv_vllm.control_ops import REPLAYED_FIELD, WAKE_FIELD
from agentkv_vllm.params import AgentKVParams, PauseSpec
from agentkv_vllm.prefetch_issuer import PrefetchIssuer
from agentkv_vllm.pump import timer_pump
from agentkv_vllm.settings import ConnectorSettings, base_engine_id

AGENTKV_KEY = "agentkv"


def trajectory_params(
    trajectory_id: str,
    branch: str = "main",
    *,
    pause_after: PauseSpec | Mapping[str, Any] | None = None,
    zones: Sequence[Mapping[str, Any]] | None = None,
    implicit_pause: bool | None = None,
    env: str | None = None,
) -> dict[str, Any]:
    """``{"agentkv": {...}}`` naming the request's trajectory and branch. ``pause_after``: the
    pause that follows this turn (``{"tool": ..., "expected_wait_s": ..., "max_lease_s": ...}``):
    the engine pauses the branch when the turn finishes and the next turn resumes it, with no
    control call. ``implicit_pause=True``: the same with no declared wait, so the wait learned
    for ``env`` (the trajectory's environment; default ``params.IMPLICIT_PAUSE_ENV``) decides,
    and not when the branch's next request is already queued (None: the connector's
    ``implicit_pause`` setting). Raises ValueError (pydantic's) for an id outside
    ``agentkv.ids``' grammar."""
    body: dict[str, Any] = {"trajectory_id": trajectory_id, "branch": branch}
    if pause_after is not None:
        spec = pause_after if isinstance(pause_after, PauseSpec) else PauseSpec(**dict(pause_after))
        body["pause_after"] = spec.model_dump(exclude_none=True)
    if implicit_pause is not None:
        body["implicit_pause"] = implicit_pause
    if env is not None:
        body["env"] = env
    if zones:
        body["zones"] = [dict(z) for z in zones]
    AgentKVParams.model_validate(body)  # the engine's own check, at the caller's edge
    return {AGENTKV_KEY: body}


def extra_args(
    trajectory_id: str,
    branch: str = "main",
    *,
    pause_after: PauseSpec | Mapping[str, Any] | None = None,
    zones: Sequence[Mapping[str, Any]] | None = None,
    implicit_pause: bool | None = None,
    env: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``SamplingParams(extra_args=...)``: ``extra`` with ``kv_transfer_params.agentkv`` set
    (other keys of ``extra`` and of its ``kv_transfer_params`` kept)."""
    out = dict(extra or {})
    ktp = dict(out.get("kv_transfer_params") or {})
    ktp.update(
        trajectory_params(
            trajectory_id,
            branch,
            pause_after=pause_after,
            zones=zones,
            implicit_pause=implicit_pause,
            env=env,
        )
    )
    out["kv_transfer_params"] = ktp
    return out


def turn_stats(output: Any) -> dict[str, Any] | None:
    """The agentkv stats of a finished ``RequestOutput`` (``turn``, ``trajectory_id``,
    ``device_hit_tokens``, ``tier_hit_tokens``, ``tier``, ``identified_by``, ...), or None: not
    finished yet, or a vanilla request (no trajectory, or malformed params: the engine log
    says why)."""
    ktp = getattr(output, "kv_transfer_params", None)
    if not isinstance(ktp, dict):
        return None
    stats = ktp.get(AGENTKV_KEY)
    return dict(stats) if isinstance(stats, dict) else None


def _control_endpoints(engine: Any) -> list[str]:
    """The control endpoints of ``engine``'s connector, one per DP rank, derived the way the
    connector and the routes derive them (``ConnectorSettings.control_endpoint``)."""
    config = engine.vllm_config
    ktc = config.kv_transfer_config
    if ktc is None:
        raise ValueError("the engine runs without --kv-transfer-config: agentkv is not enabled")
    settings = ConnectorSettings.model_validate(dict(ktc.kv_connector_extra_config or {}))
    dp_size = max(1, int(getattr(config.parallel_config, "data_parallel_size", 1) or 1))
    return [
        settings.control_endpoint(base_engine_id(ktc.engine_id, rank), rank)
        for rank in range(dp_size)
    ]


class InProcessAgentKV:
    """The trajectory ops of an in-process engine, and its timer pump.

    Each op answers ``(status, body)`` as the HTTP route would (200, 404 for an unknown
    trajectory, 409 for an op its state refuses, 422 for a bad pause); a control channel that
    does not answer raises ``control.ControlUnavailable``. ``cache_salt``: the tenant whose
    namespace the trajectory is in (the requests' ``cache_salt``; None: the unsalted one).
    """

    def __init__(self, engine: Any, timeout_s: float = 10.0) -> None:
        self.engine = engine
        self.clients = [ControlClient(e, timeout_s=timeout_s) for e in _control_endpoints(engine)]
        self.issuers = [
            PrefetchIssuer(engine, rank if len(self.clients) > 1 else None)
            for rank in range(len(self.clients))
        ]
        self._pumps: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> InProcessAgentKV:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def start(self) -> None:
        """Start the timer pump (one per DP rank) on the running event loop; idempotent."""
        if self._pumps:
            return
        loop = asyncio.get_running_loop()
        self._pumps = [
            loop.create_task(timer_pump(client, issuer, self.engine))
            for client, issuer in zip(self.clients, self.issuers, strict=True)
        ]

    async def close(self) -> None:
        """Stop the pump and the prefetches it issued; close the sockets."""
        for task in self._pumps:
            task.cancel()
        for task in self._pumps:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._pumps = []
        for issuer in self.issuers:
            issuer.close()
        for client in self.clients:
            client.close()

    async def pause(
        self,
        trajectory_id: str,
        tool: str | Sequence[str],
        expected_wait_s: float | None = None,
        *,
        branch: str = "main",
        max_lease_s: float | None = None,
        cache_salt: str | None = None,
        idempotency_key: str | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """The pause route without HTTP: ``tool`` (or the tools of parallel calls) is what the
        wait is learned under; the answer carries the decision (retain, offload_host, ...)."""
        tools = [tool] if isinstance(tool, str) else list(tool)
        spec = PauseSpec(
            tool=tools[0] if len(tools) == 1 else None,
            tools=tools if len(tools) > 1 else None,
            expected_wait_s=expected_wait_s,
            max_lease_s=max_lease_s,
        )
        fields = spec.model_dump(exclude_none=True)
        return await self._op("pause", trajectory_id, branch, cache_salt, idempotency_key, **fields)

    async def resume(
        self,
        trajectory_id: str,
        *,
        branch: str = "main",
        cache_salt: str | None = None,
        idempotency_key: str | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """The tool returned: the branch's reload starts now (the next turn would start it
        too; calling it early overlaps the reload with building the next prompt)."""
        return await self._op("resume", trajectory_id, branch, cache_salt, idempotency_key)

    async def end(
        self,
        trajectory_id: str,
        *,
        cache_salt: str | None = None,
        idempotency_key: str | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """DELETE: release everything the trajectory holds (device pins, tier copies)."""
        return await self._op("end", trajectory_id, None, cache_salt, idempotency_key)

    async def get(
        self, trajectory_id: str, *, cache_salt: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        """State, tier residency and prefix stats of the trajectory's branches."""
        return await self._op("get", trajectory_id, None, cache_salt, None)

    async def status(self, *, operator: bool = True) -> tuple[int, dict[str, Any]]:
        """The engine's status (DP rank 0). In process the caller owns the engine, so the
        operator's cross-tenant view is the default."""
        status, body = await self.clients[0].call("status", operator=operator)
        await self._wake(body)
        return status, body

    async def _op(
        self,
        op: str,
        trajectory_id: str,
        branch: str | None,
        cache_salt: str | None,
        idempotency_key: str | None,
        **fields: Any,
    ) -> tuple[int, dict[str, Any]]:
        fields["trajectory_id"] = AgentKVParams(trajectory_id=trajectory_id).trajectory_id
        if branch is not None:
            fields["branch"] = AgentKVParams(trajectory_id=trajectory_id, branch=branch).branch
        if cache_salt:
            fields[TENANT_FIELD] = cache_salt
        if idempotency_key is not None:
            fields[KEY_FIELD] = idempotency_key
        if len(self.clients) > 1:
            from agentkv_vllm.routes import _fan_out  # every DP rank may hold the trajectory

            status, body = await _fan_out(self.clients, op, **fields)
        else:
            status, body = await self.clients[0].call(op, **fields)
        body.pop(REPLAYED_FIELD, None)
        await self._wake(body)
        return status, body

    async def _wake(self, body: dict[str, Any]) -> None:
        """Wake an idle engine loop for the work the op left (any utility call does)."""
        if body.pop(WAKE_FIELD, False):
            await self.engine.is_sleeping()
