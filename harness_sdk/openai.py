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

The paths agent frameworks call are covered too (each carries the header and the params):
``create`` / ``stream`` / ``parse`` of ``chat.completions``, ``completions``, ``responses``,
``beta.chat.completions`` and (Anthropic) ``messages`` / ``beta.messages``; the same through
``.with_raw_response`` (LangChain's ``ChatOpenAI``) and ``.with_streaming_response`` (the Agents
SDK's streamed Responses), on a resource or on the client; and ``with_options(...)`` /
``copy(...)`` (retries, timeouts) return a wrapped client of the same trajectory. Every other
call goes through a copy of the client whose default headers carry ``x-session-id``, so even a
path the wrapper does not know (a tool runner, a new resource) names the trajectory on the
server (the header hint). Where a view cannot be rebuilt around the wrapper, the SDK's own
(bypassed) view is returned with one DegradedWarning; ``close()`` of a wrapper that decorated no
request says so.

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
import logging
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx

from harness_sdk.adapters import SESSION_HEADER, AgentKVAdapter
from harness_sdk.errors import ConfigError, DegradedWarning, TrajectoryClosedError
from harness_sdk.session import _check_id, _normalize_base, _Shared
from harness_sdk.telemetry import Telemetry
from harness_sdk.tool_wait import ToolWait, run_tool_wait

log = logging.getLogger("harness_sdk.openai")
# The SDKs' per-call views: each wraps the methods of the resource (or client) it is built on.
_VIEWS = ("with_raw_response", "with_streaming_response")
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    """One DegradedWarning (and log line) per kind of bypass, per process."""
    if key in _warned:
        return
    _warned.add(key)
    log.warning("harness_sdk: %s", message)
    warnings.warn(message, DegradedWarning, stacklevel=3)


def _view(wrapper: Any, inner: Any, name: str) -> Any:
    """The SDK's ``inner.<name>`` view (``with_raw_response`` / ``with_streaming_response``)
    rebuilt around ``wrapper``, so its methods call the wrapper's (decorated) ones."""
    original = getattr(inner, name)
    try:
        return type(original)(wrapper)
    except Exception as exc:
        _warn_once(
            f"{type(inner).__name__}.{name}",
            f"{type(inner).__name__}.{name} could not be wrapped ({exc!r}): calls through it "
            "carry only the x-session-id default header, not kv_transfer_params",
        )
        return original


class _Proxy:
    """Delegates every attribute to ``inner`` except the ones defined on the subclass; its
    ``with_raw_response`` / ``with_streaming_response`` views call back into it."""

    def __init__(self, owner: _OpenAIBase, inner: Any) -> None:
        self._owner = owner
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _VIEWS:
            return _view(self, self._inner, name)
        return getattr(self._inner, name)


class _Create(_Proxy):
    """``chat.completions`` / ``completions`` / ``responses`` / (Anthropic) ``messages``:
    ``create``, ``stream`` and ``parse`` carry the trajectory."""

    def create(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.create(*args, **self._owner._decorate(kwargs))

    def stream(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.stream(*args, **self._owner._decorate(kwargs))

    def parse(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.parse(*args, **self._owner._decorate(kwargs))


class _Chat(_Proxy):
    @property
    def completions(self) -> _Create:
        return _Create(self._owner, self._inner.completions)


class _Beta(_Proxy):
    """``beta``: Anthropic's ``beta.messages`` (pydantic-ai's Anthropic model calls it),
    OpenAI's ``beta.chat.completions``."""

    @property
    def messages(self) -> _Create:
        return _Create(self._owner, self._inner.messages)

    @property
    def chat(self) -> _Chat:
        return _Chat(self._owner, self._inner.chat)


@dataclass
class _Usage:
    """What a wrapper and the clients derived from it (``with_options``) count together."""

    requests: int = 0


def _with_session_header(client: Any, trajectory_id: str) -> Any:
    """A copy of ``client`` (the same connection pool) whose default headers name the
    trajectory: calls that bypass the wrapper's decoration still carry the session hint."""
    with_options = getattr(client, "with_options", None)
    if not callable(with_options):
        return client
    try:
        return with_options(default_headers={SESSION_HEADER: trajectory_id})
    except Exception as exc:  # a duck-typed client with another signature
        log.debug("harness_sdk: no session-header copy of %r: %r", type(client).__name__, exc)
        return client


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
        cache_salt: str | None = None,
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
        """The caller's client, untouched."""
        self._routed = _with_session_header(client, tid)
        """The client every call goes through: the caller's, with the session header."""
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
            cache_salt=cache_salt,
        )
        self._usage = _Usage()
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
    def requests(self) -> int:
        """Requests decorated so far (by this wrapper and the ones ``with_options`` made)."""
        return self._usage.requests

    @property
    def routes_available(self) -> bool | None:
        """True/False once known whether the server has the agentkv routes; None before."""
        return self._shared.routes

    @property
    def chat(self) -> _Chat:
        return _Chat(self, self._routed.chat)

    @property
    def completions(self) -> _Create:
        return _Create(self, self._routed.completions)

    @property
    def responses(self) -> _Create:
        """``client.responses.create(...)`` (the Responses API) with the trajectory."""
        return _Create(self, self._routed.responses)

    @property
    def beta(self) -> _Beta:
        return _Beta(self, self._routed.beta)

    @property
    def with_raw_response(self) -> Any:
        """``client.with_raw_response.chat.completions.create(...)`` with the trajectory."""
        return _view(self, self._routed, "with_raw_response")

    @property
    def with_streaming_response(self) -> Any:
        return _view(self, self._routed, "with_streaming_response")

    def with_options(self, **options: Any) -> Any:
        """The client's ``with_options`` (retries, timeouts, headers), still this trajectory:
        a wrapper sharing this one's state (a request through either counts for ``close``)."""
        return self._derive(self.client.with_options(**options))

    def copy(self, **options: Any) -> Any:
        return self._derive(self.client.copy(**options))

    def _derive(self, client: Any) -> Any:
        derived = copy.copy(self)  # shares _shared, _usage, tool waits, a sync wrapper's loop
        derived.client = client
        derived._routed = _with_session_header(client, self.trajectory_id)
        return derived

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this wrapper lacks; never for its own (half-built) state.
        if name.startswith("_") or name in ("client", "_routed"):
            raise AttributeError(name)
        return getattr(self._routed, name)

    def _warn_unused(self) -> None:
        if not self._usage.requests:
            _warn_once(
                f"unused:{type(self).__name__}",
                f"{type(self).__name__} {self.trajectory_id!r} closed without decorating a "
                "request: if the agent called the client, it used a path the wrapper does not "
                "cover (only the x-session-id default header went along)",
            )

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
        # The tenant goes on every request, with or without agentkv's params.
        salted = self._shared.turn_extra(out.get("extra_body"))
        if salted is not None:
            out["extra_body"] = salted
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
        self._usage.requests += 1
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
        if not self._shared.closed:
            self._warn_unused()
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
        if not self._shared.closed:
            self._warn_unused()
        self._shared.closed = True
        try:
            if self.requests:
                out: dict[str, Any] | None = self._run(self._shared.delete_trajectory())
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
    ``meter_provider``, ``cache_salt`` (the trajectory's tenant: every request's body and every
    agentkv route call carry it; set it here, not in ``extra_body``).
    """
    cls = AsyncOpenAITrajectory if _is_async(client) else OpenAITrajectory
    return cls(client, trajectory_id, branch, **kwargs)


__all__ = ["AsyncOpenAITrajectory", "OpenAITrajectory", "wrap"]
