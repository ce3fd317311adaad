"""The official ``openai`` client as an agentkv trajectory: a drop-in for agent loops that
already talk to vLLM through ``openai.OpenAI`` / ``openai.AsyncOpenAI``.

    from openai import OpenAI
    from harness_sdk.openai import wrap

    client = wrap(OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY), "task-42")
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS)
    with client.tool("run_tests", expected_s=30) as call:   # pause, measure, resume
        output = run_tests()
    ...
    client.close()                                          # DELETE the trajectory on the server

Every ``chat.completions.create`` / ``completions.create`` / ``responses.create`` call gets
``extra_headers={"x-session-id": trajectory_id}`` (what routers such as vllm-router key session
affinity on) and ``extra_body={"kv_transfer_params": {"agentkv": {"trajectory_id", "branch"}}}``
merged into whatever the caller passes (the caller's other ``kv_transfer_params`` keys, e.g.
``zones``, are kept). ``tool()`` is the same tool wait as ``Trajectory.tool`` (``ToolWait``: the
agentkv pause and resume routes, a ``tool_wait`` span, skipped with one DegradedWarning on a
server without the routes). Without ``tool()`` the server still pauses on its own when a reply
has tool calls (auto-pause), learning the wait per tool; ``tool()`` adds the harness's own
``expected_s`` and overrides that decision.

The Responses API (``client.responses.create``, vLLM's ``/v1/responses``) carries the same
identity; a reply with function calls auto-pauses the trajectory like a chat reply does. With
``previous_response_id`` the server would follow the chain on its own; the wrapper names the
trajectory anyway, so a chain and a wrapped client never disagree.

Primitives:
  wrap(client, trajectory_id=None, branch="main", ...) -> OpenAITrajectory | AsyncOpenAITrajectory
  OpenAITrajectory        sync: ``.chat.completions.create``, ``.responses.create``,
                          ``with .tool(...)``, ``.close()``
  AsyncOpenAITrajectory   async: the same with ``await`` / ``async with``
Every other attribute is the wrapped client's (``client.models.list()`` works as before). The
``openai`` package itself is never imported here (duck typing), so the SDK does not depend on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import uuid
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import httpx

from harness_sdk.adapters import SESSION_HEADER, AgentKVAdapter
from harness_sdk.errors import ConfigError, TrajectoryClosedError
from harness_sdk.session import _check_id, _normalize_base, _Shared
from harness_sdk.telemetry import Telemetry
from harness_sdk.tool_wait import ToolWait, run_tool_wait


class _Proxy:
    """Delegates every attribute to ``inner`` except the ones defined on the subclass."""

    def __init__(self, owner: _OpenAIBase, inner: Any) -> None:
        self._owner = owner
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._inner, name)


class _Create(_Proxy):
    """``chat.completions`` / ``completions`` / ``responses`` / (Anthropic) ``messages``:
    ``create`` and ``stream`` carry the trajectory."""

    def create(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.create(*args, **self._owner._decorate(kwargs))

    def stream(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.stream(*args, **self._owner._decorate(kwargs))


class _Chat(_Proxy):
    @property
    def completions(self) -> _Create:
        return _Create(self._owner, self._inner.completions)


class _OpenAIBase:
    def __init__(
        self,
        client: Any,
        trajectory_id: str | None = None,
        branch: str = "main",
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        send_params: bool = True,
        timeout: float = 30.0,
        http_client: httpx.AsyncClient | None = None,
        tracer_provider: Any = None,
        meter_provider: Any = None,
    ) -> None:
        tid = _check_id(
            trajectory_id if trajectory_id is not None else f"traj-{uuid.uuid4().hex[:16]}",
            "trajectory_id",
        )
        self.branch = _check_id(branch, "branch")
        url = base_url if base_url is not None else str(getattr(client, "base_url", "") or "")
        if not url:
            raise ConfigError("cannot tell the server's URL from the client; pass base_url=")
        key = api_key if api_key is not None else getattr(client, "api_key", None)
        self.client = client
        self.send_params = send_params
        self._shared = _Shared(
            _normalize_base(url),
            "",
            key or None,
            tid,
            AgentKVAdapter(),
            http_client,
            timeout,
            Telemetry(tracer_provider, meter_provider),
        )
        self.requests = 0
        self.tool_waits: list[ToolWait] = []
        self.observations: list[dict[str, str]] = []
        """What ``call.observe(...)`` recorded, as messages (the caller owns ``messages``)."""

    # --- what ToolWait needs ------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._shared.closed:
            raise TrajectoryClosedError(f"{self.trajectory_id} is closed")

    def observe(self, content: str, role: str = "user") -> None:
        self.observations.append({"role": role, "content": content})

    # --- the client surface --------------------------------------------------------------------
    @property
    def trajectory_id(self) -> str:
        return self._shared.trajectory_id

    @property
    def routes_available(self) -> bool | None:
        """True/False once known whether the server has the agentkv routes; None before."""
        return self._shared.routes

    @property
    def chat(self) -> _Chat:
        return _Chat(self, self.client.chat)

    @property
    def completions(self) -> _Create:
        return _Create(self, self.client.completions)

    @property
    def responses(self) -> _Create:
        """``client.responses.create(...)`` (the Responses API) with the trajectory."""
        return _Create(self, self.client.responses)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this wrapper lacks; never for its own (half-built) state.
        if name.startswith("_") or name == "client":
            raise AttributeError(name)
        return getattr(self.client, name)

    def _decorate(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` plus the session header and ``kv_transfer_params.agentkv``."""
        self._check_open()
        out = dict(kwargs)
        if isinstance(out.get("model"), str) and out["model"]:
            self._shared.model = out["model"]  # control calls carry it (routers scope by model)
        headers = dict(out.get("extra_headers") or {})
        if not any(k.lower() == SESSION_HEADER for k in headers):
            headers[SESSION_HEADER] = self.trajectory_id
        out["extra_headers"] = headers
        if self.send_params:
            body = copy.deepcopy(dict(out.get("extra_body") or {}))
            params = body.get("kv_transfer_params")
            params = dict(params) if isinstance(params, dict) else {}
            agentkv = params.get("agentkv")
            agentkv = dict(agentkv) if isinstance(agentkv, dict) else {}
            agentkv.update(trajectory_id=self.trajectory_id, branch=self.branch)
            params["agentkv"] = agentkv
            body["kv_transfer_params"] = params
            # the same session hint as the control calls: vllm-router keys affinity per source
            body.setdefault("agent_hint", {"session_id": self.trajectory_id})
            out["extra_body"] = body
        self.requests += 1
        return out

    def tool(self, name: str, expected_s: float | None = None) -> Any:
        raise NotImplementedError


class AsyncOpenAITrajectory(_OpenAIBase):
    """An ``openai.AsyncOpenAI`` client bound to one trajectory branch."""

    def tool(self, name: str, expected_s: float | None = None) -> ToolWait:
        """``async with client.tool("pytest", expected_s=45) as call:`` around a tool's run."""
        return ToolWait(self, name, expected_s)

    async def server_state(self) -> dict[str, Any] | None:
        """GET the trajectory on the server (None if unknown or the routes are absent)."""
        return await self._shared.trajectory_state()

    async def server_status(self) -> dict[str, Any] | None:
        return await self._shared.server_status()

    async def close(self) -> dict[str, Any] | None:
        """DELETE the trajectory on the server (when a request was sent); idempotent. The
        wrapped openai client stays open (it is the caller's)."""
        return await self._shared.close_trajectory(used=bool(self.requests))

    async def __aenter__(self) -> AsyncOpenAITrajectory:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class OpenAITrajectory(_OpenAIBase):
    """An ``openai.OpenAI`` client bound to one trajectory branch; the agentkv routes run on a
    private event loop (not usable inside a running loop: wrap an AsyncOpenAI there)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop()
            raise ConfigError(
                "a wrapped sync OpenAI client cannot run inside an event loop; wrap AsyncOpenAI"
            )
        super().__init__(*args, **kwargs)
        self._loop = asyncio.new_event_loop()

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(coro)

    @contextlib.contextmanager
    def tool(self, name: str, expected_s: float | None = None) -> Iterator[ToolWait]:
        """``with client.tool("pytest", expected_s=45) as call:`` around a tool's run."""
        with run_tool_wait(self._loop, ToolWait(self, name, expected_s)) as wait:
            yield wait

    def server_state(self) -> dict[str, Any] | None:
        state: dict[str, Any] | None = self._run(self._shared.trajectory_state())
        return state

    def server_status(self) -> dict[str, Any] | None:
        status: dict[str, Any] | None = self._run(self._shared.server_status())
        return status

    def close(self) -> dict[str, Any] | None:
        """DELETE the trajectory on the server (when a request was sent); idempotent. The
        wrapped openai client stays open (it is the caller's)."""
        if self._loop.is_closed():
            return None
        self._shared.closed = True
        try:
            if self.requests:
                out: dict[str, Any] | None = self._run(
                    self._shared.control("DELETE", f"/trajectories/{self.trajectory_id}")
                )
                return out
            return None
        finally:
            self._run(self._shared.aclose())
            self._loop.close()

    def __enter__(self) -> OpenAITrajectory:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _is_async(client: Any) -> bool:
    try:
        import openai
    except ImportError:  # pragma: no cover - duck typing below
        openai = None  # type: ignore[assignment]
    if openai is not None:
        if isinstance(client, openai.AsyncOpenAI):
            return True
        if isinstance(client, openai.OpenAI):
            return False
    return "async" in type(client).__name__.lower()


def wrap(
    client: Any,
    trajectory_id: str | None = None,
    branch: str = "main",
    **kwargs: Any,
) -> Any:
    """Bind an ``openai.OpenAI`` (-> OpenAITrajectory) or ``openai.AsyncOpenAI``
    (-> AsyncOpenAITrajectory) client to one trajectory branch.

    ``trajectory_id``: the agentkv id grammar (``agentkv.ids``); a random ``traj-...`` when
    omitted. Keyword options: ``base_url`` / ``api_key`` (default: the client's own, used for
    the agentkv routes), ``send_params`` (False: only the ``x-session-id`` header, for servers
    that must not see ``kv_transfer_params``), ``timeout`` (of the route calls),
    ``http_client`` (an httpx.AsyncClient for the routes), ``tracer_provider``,
    ``meter_provider``.
    """
    cls = AsyncOpenAITrajectory if _is_async(client) else OpenAITrajectory
    return cls(client, trajectory_id, branch, **kwargs)


__all__ = ["AsyncOpenAITrajectory", "OpenAITrajectory", "wrap"]
