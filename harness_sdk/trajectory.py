"""Trajectories: zoned turns, tool waits, forks and close, over httpx (async first).

Primitives:
  Trajectory(base_url, model, ...)     async; ``async with``; one branch of one trajectory
                                       (``cache_salt=``: its tenant, on every call it makes)
    .observe(text) / .remember(text) / .set_system(text) / .set_tools(tools)   edit the zones
    await .complete(user?, max_tokens=, temperature=, stream=) -> TurnResult     one turn
    async with .tool(name, expected_s=) as call: ...   pause, measure, resume (even on error)
    .fork(n) -> [Trajectory]  .prune()  .join(branch)  branches sharing the prefix
    await .close()            DELETE on the server (root) or prune (branch)
    await .server_state() / await .server_status()   the agentkv GET routes (None if absent)
  SyncTrajectory                       the same API, blocking, on a private event loop
  TurnResult                           reply, CacheUsage, engine stats, zone changes, lint
                                       (harness_sdk.turn, with the checks before a turn)
  ToolWait                             the ``tool(...)`` context manager; decision, duration
                                       (harness_sdk.tool_wait)
The HTTP plumbing every branch of a trajectory shares (client, routes, streaming, the agentkv
control calls) is harness_sdk.session.

The server's agentkv routes are used when it has them; on a server without them (plain vLLM,
a hosted API: 404/405/503 on ``/agentkv/v1``) pause/resume/close are skipped with one
DegradedWarning and turns keep working. A pause the engine answers with ``applied: false`` is
reported with one PauseNotAppliedWarning per trajectory.

Trajectory ids and branch names follow ``agentkv.ids`` (the grammar the server's params and
routes use); one outside it raises InvalidIdError at construction or fork, before any request.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, Literal

import httpx

from harness_sdk.adapters import Adapter, AgentKVAdapter
from harness_sdk.errors import ConfigError, LayoutError, TrajectoryClosedError
from harness_sdk.session import _check_id, _normalize_base, _Shared
from harness_sdk.telemetry import Telemetry
from harness_sdk.tool_wait import DeclaredPause, ToolHost, ToolWait, check_tool_args, run_tool_wait
from harness_sdk.turn import TurnResult, check_turn, record_turn
from harness_sdk.zones import Context, RenderedContext


class Trajectory:
    """One branch of an agent trajectory against an OpenAI-compatible server (async)."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        model: str = "",
        *,
        api_key: str | None = None,
        trajectory_id: str | None = None,
        branch: str = "main",
        system: str | None = None,
        tools: Iterable[Mapping[str, Any]] = (),
        memory: Iterable[Mapping[str, Any]] = (),
        recent_turns: int = 4,
        tools_as: Literal["param", "message"] = "param",
        adapter: Adapter | None = None,
        http_client: httpx.AsyncClient | None = None,
        timeout: float = 120.0,
        max_tokens: int | None = None,
        temperature: float | None = None,
        tracer_provider: Any = None,
        meter_provider: Any = None,
        cache_salt: str | None = None,
    ) -> None:
        """``cache_salt``: the trajectory's tenant (vLLM's per-request cache salt). Every turn
        carries it in its body and every agentkv control call (pause, resume, GET, DELETE) in
        the ``X-AgentKV-Cache-Salt`` header and its body; set it here, not in ``extra_body``."""
        tid = _check_id(
            trajectory_id if trajectory_id is not None else f"traj-{uuid.uuid4().hex[:16]}",
            "trajectory_id",
        )
        branch = _check_id(branch, "branch")
        if not model:
            raise ConfigError("model is required")
        self._shared = _Shared(
            _normalize_base(base_url),
            model,
            api_key,
            tid,
            adapter or AgentKVAdapter(),
            http_client,
            timeout,
            Telemetry(tracer_provider, meter_provider),
            cache_salt=cache_salt,
        )
        self.branch = branch
        self.context = Context(system, tools, memory, recent_turns=recent_turns, tools_as=tools_as)
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.results: list[TurnResult] = []
        self.tool_waits: list[ToolWait] = []
        self.parent: Trajectory | None = None
        self.children: list[Trajectory] = []
        self.pruned = False
        self._turn = 0
        self._fork_seq = 0
        self._last: RenderedContext | None = None
        self._last_reply: dict[str, Any] | None = None
        self._declared: DeclaredPause | None = None

    # --- properties --------------------------------------------------------------------------
    @property
    def trajectory_id(self) -> str:
        return self._shared.trajectory_id

    @property
    def model(self) -> str:
        return self._shared.model

    @property
    def cache_salt(self) -> str | None:
        """The trajectory's tenant (None: the unsalted namespace)."""
        return self._shared.cache_salt

    @property
    def turn(self) -> int:
        """Turns completed on this branch (a fork inherits its parent's count)."""
        return self._turn

    @property
    def closed(self) -> bool:
        return self._shared.closed or self.pruned

    @property
    def routes_available(self) -> bool | None:
        """True/False once known whether the server has the agentkv routes; None before."""
        return self._shared.routes

    def _check_open(self) -> None:
        if self.closed:
            raise TrajectoryClosedError(
                f"{self.trajectory_id}/{self.branch} is {'pruned' if self.pruned else 'closed'}"
            )

    # --- zones -------------------------------------------------------------------------------
    def observe(self, content: str, role: str = "user") -> None:
        """Add a message to the observation zone (sent with the next turn)."""
        self.context.observe(content, role=role)

    def remember(self, content: str, role: str = "user") -> None:
        """Pin a long-lived message at the end of the memory zone."""
        self.context.remember(content, role=role)

    def set_system(self, system: str | None) -> None:
        self.context.system = system

    def set_tools(self, tools: Iterable[Mapping[str, Any]]) -> None:
        self.context.set_tools(tools)

    # --- turns -------------------------------------------------------------------------------
    async def complete(
        self,
        user: str | None = None,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        extra_body: dict[str, Any] | None = None,
        stream: bool = False,
        then_tool: str | None = None,
        then_expected_s: float | None = None,
    ) -> TurnResult:
        """Send one turn (``user`` is added to the observation first) and commit the reply.

        ``stream=True`` sends an SSE request with ``stream_options.include_usage`` and sets
        ``TurnResult.ttft_s``. vLLM returns the agentkv per-turn stats only in non-streamed
        responses, so a streamed turn has ``engine`` None (``server_state()`` still has them).

        ``then_tool`` (an agent that knows its next step is that tool): the request asks the
        engine to pause the branch when the turn finishes (``pause_after``), and the next
        ``tool(then_tool)`` on this branch makes no pause and no resume call (the next turn
        resumes it): a tool wait with no control call. Its ``decision`` is the one the reply
        carried (None for a streamed turn).
        """
        self._check_open()
        if then_tool is not None:
            check_tool_args(then_tool, then_expected_s)
        if user is not None:
            self.observe(user)
        shared = self._shared
        self._declared = None  # a declared pause no tool wait used ends with this turn
        rendered = self.context.render()
        if not rendered.messages:
            raise LayoutError("nothing to send: the context is empty")
        turn = self._turn + 1
        checks = check_turn(rendered, turn, self._last, self._last_reply, shared.seen_lint)
        mt = max_tokens if max_tokens is not None else self.max_tokens
        temp = temperature if temperature is not None else self.temperature
        body = shared.adapter.build_request(
            rendered,
            model=shared.model,
            trajectory_id=shared.trajectory_id,
            branch=self.branch,
            max_tokens=mt,
            temperature=temp,
            extra=shared.turn_extra(extra_body),
            pause_after={"tool": then_tool, "expected_wait_s": then_expected_s}
            if then_tool is not None and shared.adapter.supports_control
            else None,
        )
        with shared.telemetry.turn_span(
            model=shared.model,
            provider=shared.adapter.provider,
            trajectory_id=shared.trajectory_id,
            branch=self.branch,
            turn=turn,
            max_tokens=mt,
            temperature=temp,
            server=shared.server,
        ) as span:
            payload, latency, ttft = await shared.send_turn(body, stream)
            parsed = shared.adapter.parse_response(payload if isinstance(payload, dict) else {})
            result = TurnResult(
                shared.trajectory_id,
                self.branch,
                turn,
                parsed.content,
                parsed.message,
                parsed.usage,
                parsed.engine,
                checks.changes,
                checks.lint,
                checks.divergence,
                checks.divergence_zone,
                latency,
                parsed.finish_reasons,
                payload,
                ttft,
            )
            record_turn(shared, span, result, parsed)
        self._last, self._last_reply = rendered, parsed.message
        self.context.commit_turn(parsed.message)
        self._turn = turn
        self.results.append(result)
        if then_tool is not None and shared.adapter.supports_control:
            answer = (parsed.engine or {}).get("pause")
            self._declared = DeclaredPause(then_tool, answer if isinstance(answer, dict) else None)
        return result

    def tool(self, name: str, expected_s: float | None = None) -> ToolWait:
        """``async with traj.tool("pytest", expected_s=45) as call:`` around a tool's run."""
        return ToolWait(self, name, expected_s)

    # --- branches ----------------------------------------------------------------------------
    def fork(self, n: int) -> list[Trajectory]:
        """``n`` branches sharing this branch's context (and so its cached prefix)."""
        self._check_open()
        if n < 1:
            raise LayoutError("fork(n) needs n >= 1")
        out: list[Trajectory] = []
        for _ in range(n):
            self._fork_seq += 1
            child = object.__new__(Trajectory)
            child.__dict__.update(
                {
                    "_shared": self._shared,
                    "branch": f"{self.branch}.{self._fork_seq}",
                    "context": self.context.copy(),
                    "max_tokens": self.max_tokens,
                    "temperature": self.temperature,
                    "results": [],
                    "tool_waits": [],
                    "parent": self,
                    "children": [],
                    "pruned": False,
                    "_turn": self._turn,
                    "_fork_seq": 0,
                    "_last": self._last,
                    "_last_reply": self._last_reply,
                    "_declared": None,
                }
            )
            _check_id(child.branch, "branch")  # the grammar's length limit
            out.append(child)
        self.children.extend(out)
        return out

    def prune(self) -> None:
        """Drop this branch locally: it takes no more turns (its blocks age out on the server;
        the root's close() releases everything)."""
        if self.parent is None:
            raise LayoutError("the root branch cannot be pruned; close() it")
        self.pruned = True
        for c in self.children:
            if not c.pruned:
                c.prune()

    def join(self, winner: Trajectory) -> None:
        """Adopt a child branch's context and turns; prune every other child."""
        self._check_open()
        if winner not in self.children:
            raise LayoutError(f"{winner.branch!r} is not a child of {self.branch!r}")
        winner._check_open()
        self.context = winner.context.copy()
        self._turn, self._last, self._last_reply = winner._turn, winner._last, winner._last_reply
        self.results.extend(winner.results)
        for c in self.children:
            if not c.pruned:
                c.prune()
        self.children = []

    # --- server state ------------------------------------------------------------------------
    async def server_state(self) -> dict[str, Any] | None:
        """GET the trajectory on the server (None if unknown or the routes are absent)."""
        return await self._shared.trajectory_state()

    async def server_status(self) -> dict[str, Any] | None:
        """GET /agentkv/v1/status (None if the routes are absent)."""
        return await self._shared.server_status()

    async def close(self) -> dict[str, Any] | None:
        """Root: DELETE the trajectory (all branches, every tier) and close the HTTP client.
        Branch: prune it. Idempotent. Returns the server's release counts when it answered."""
        if self.parent is not None:
            if not self.pruned:
                self.prune()
            return None
        return await self._shared.close_trajectory(used=bool(self._turn or self.children))

    async def __aenter__(self) -> Trajectory:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class SyncTrajectory:
    """Blocking twin of Trajectory on a private event loop (not usable inside a running loop)."""

    def __init__(
        self,
        *args: Any,
        _wrap: Trajectory | None = None,
        _loop: asyncio.AbstractEventLoop | None = None,
        **kwargs: Any,
    ) -> None:
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop()
            raise ConfigError("SyncTrajectory cannot run inside an event loop; use Trajectory")
        self._owns_loop = _loop is None
        self._loop = _loop or asyncio.new_event_loop()
        self.async_trajectory = _wrap or Trajectory(*args, **kwargs)

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(coro)

    trajectory_id = property(lambda self: self.async_trajectory.trajectory_id)
    branch = property(lambda self: self.async_trajectory.branch)
    turn = property(lambda self: self.async_trajectory.turn)
    results = property(lambda self: self.async_trajectory.results)
    context = property(lambda self: self.async_trajectory.context)
    closed = property(lambda self: self.async_trajectory.closed)

    def observe(self, content: str, role: str = "user") -> None:
        self.async_trajectory.observe(content, role)

    def remember(self, content: str, role: str = "user") -> None:
        self.async_trajectory.remember(content, role)

    def set_system(self, system: str | None) -> None:
        self.async_trajectory.set_system(system)

    def set_tools(self, tools: Iterable[Mapping[str, Any]]) -> None:
        self.async_trajectory.set_tools(tools)

    def complete(self, user: str | None = None, **kwargs: Any) -> TurnResult:
        result: TurnResult = self._run(self.async_trajectory.complete(user, **kwargs))
        return result

    @contextlib.contextmanager
    def tool(self, name: str, expected_s: float | None = None) -> Iterator[ToolWait]:
        with run_tool_wait(self._loop, self.async_trajectory.tool(name, expected_s)) as wait:
            yield wait

    def fork(self, n: int) -> list[SyncTrajectory]:
        return [SyncTrajectory(_wrap=c, _loop=self._loop) for c in self.async_trajectory.fork(n)]

    def prune(self) -> None:
        self.async_trajectory.prune()

    def join(self, winner: SyncTrajectory) -> None:
        self.async_trajectory.join(winner.async_trajectory)

    def server_state(self) -> dict[str, Any] | None:
        state: dict[str, Any] | None = self._run(self.async_trajectory.server_state())
        return state

    def server_status(self) -> dict[str, Any] | None:
        status: dict[str, Any] | None = self._run(self.async_trajectory.server_status())
        return status

    def close(self) -> dict[str, Any] | None:
        if self._loop.is_closed():
            return None
        out: dict[str, Any] | None = self._run(self.async_trajectory.close())
        if self._owns_loop:
            self._loop.close()
        return out

    def __enter__(self) -> SyncTrajectory:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


__all__ = ["SyncTrajectory", "ToolHost", "ToolWait", "Trajectory", "TurnResult", "run_tool_wait"]
