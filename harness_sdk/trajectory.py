"""Trajectories: zoned turns, tool waits, forks and close, over httpx (async first).

Primitives:
  Trajectory(base_url, model, ...)     async; ``async with``; one branch of one trajectory
    .observe(text) / .remember(text) / .set_system(text) / .set_tools(tools)   edit the zones
    await .complete(user?, max_tokens=, temperature=, stream=) -> TurnResult     one turn
    async with .tool(name, expected_s=) as call: ...   pause, measure, resume (even on error)
    .fork(n) -> [Trajectory]  .prune()  .join(branch)  branches sharing the prefix
    await .close()            DELETE on the server (root) or prune (branch)
    await .server_state() / await .server_status()   the agentkv GET routes (None if absent)
  TurnResult                           reply, CacheUsage, engine stats, zone changes, lint
  ToolWait                             the ``tool(...)`` context manager; decision, duration
  SyncTrajectory                       the same API, blocking, on a private event loop

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
import contextvars
import json as jsonlib
import logging
import sys
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

import httpx

from agentkv import ids as _ids
from harness_sdk.adapters import SESSION_HEADER, Adapter, AgentKVAdapter, CacheUsage
from harness_sdk.errors import (
    AuthenticationError,
    ConfigError,
    DegradedWarning,
    InvalidIdError,
    LayoutError,
    PauseNotAppliedWarning,
    StableZoneChangedWarning,
    TimeoutError_,
    TrajectoryClosedError,
    TransportError,
    VolatileContentWarning,
    status_error,
)
from harness_sdk.telemetry import ATTR_PAUSE_ACTION, ATTR_PAUSE_APPLIED, Telemetry
from harness_sdk.zones import (
    Context,
    LintFinding,
    RenderedContext,
    ZoneChange,
    check_stability,
    lint_context,
)

log = logging.getLogger("harness_sdk")


def _check_id(value: object, what: str) -> str:
    """``value`` when it is in the id grammar of ``agentkv.ids``, else InvalidIdError."""
    try:
        return _ids.validate_id(value, what)
    except _ids.InvalidIdError as exc:
        raise InvalidIdError(str(exc)) from None


@dataclass
class TurnResult:
    """One completed turn: the reply and its cache statistics."""

    trajectory_id: str
    branch: str
    turn: int
    content: str
    message: dict[str, Any]
    usage: CacheUsage
    engine: dict[str, Any] | None
    zone_changes: list[ZoneChange]
    lint: list[LintFinding]
    client_divergence_message: int | None
    client_divergence_zone: str | None
    latency_s: float
    finish_reasons: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    # Streamed turns only: seconds from sending the request to the first chunk with a choice
    # (vLLM sends it once the first output token exists, i.e. after prefill). None otherwise.
    ttft_s: float | None = None

    @property
    def cached_tokens(self) -> int:
        return self.usage.cached_tokens or 0

    @property
    def prompt_tokens(self) -> int:
        return self.usage.input_tokens or 0

    @property
    def hit_ratio(self) -> float | None:
        """The engine's prefix hit ratio when reported, else cached / prompt tokens."""
        if self.engine is not None:
            for key in ("prefix_hit_ratio", "hit_ratio"):
                v = self.engine.get(key)
                if isinstance(v, (int, float)):
                    return float(v)
        return self.usage.hit_ratio


class _Shared:
    """State shared by every branch of one trajectory: the HTTP client, routes, closed flag."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None,
        trajectory_id: str,
        adapter: Adapter,
        client: httpx.AsyncClient | None,
        timeout: float,
        telemetry: Telemetry,
    ) -> None:
        self.base_url = base_url
        self.model = model
        self.api_key = api_key
        self.trajectory_id = trajectory_id
        self.adapter = adapter
        self.owns_client = client is None
        self.client = client or httpx.AsyncClient(timeout=timeout)
        self.telemetry = telemetry
        self.routes: bool | None = None if adapter.supports_control else False
        self.closed = False
        self.seen_lint: set[LintFinding] = set()
        self.warned_pause_not_applied = False
        parts = urlsplit(base_url)
        self.server = (parts.hostname or "", parts.port)

    def session_headers(self, headers: dict[str, str]) -> dict[str, str]:
        """The routing contract: every call names its session (routers such as vllm-router key
        session affinity on it)."""
        return {**headers, SESSION_HEADER: self.trajectory_id}

    async def request(self, method: str, path: str, json: Any = None) -> httpx.Response:
        if path.startswith("/agentkv/"):
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            # vllm-router drops client headers on routes it does not know: the model and the
            # session travel in the body too, as on the trajectory's chat calls.
            json = {**(json or {}), "agent_hint": self.agent_hint()}
            if self.model:
                json["model"] = self.model
        else:
            headers = self.adapter.headers(self.api_key)
        headers = self.session_headers(headers)
        try:
            return await self.client.request(
                method, self.base_url + path, json=json, headers=headers
            )
        except httpx.TimeoutException as exc:
            raise TimeoutError_(f"{method} {path} timed out: {exc}") from exc
        except httpx.TransportError as exc:
            raise TransportError(f"{method} {path} failed: {exc!r}") from exc

    def agent_hint(self) -> dict[str, str]:
        return {"session_id": self.trajectory_id}

    async def stream_chat(
        self, path: str, json: Any, headers: dict[str, str]
    ) -> tuple[int, Any, float | None]:
        """POST a streaming (SSE) chat request; return (status, payload, ttft_s).

        The payload is reassembled into the shape of a non-streamed response (one choice, the
        concatenated content, the final usage chunk) so adapters parse both alike.
        """
        t0 = time.monotonic()
        ttft: float | None = None
        content: list[str] = []
        reasons: dict[int, str] = {}
        payload: dict[str, Any] = {}
        role = "assistant"
        try:
            async with self.client.stream(
                "POST", self.base_url + path, json=json, headers=headers
            ) as r:
                if r.status_code >= 400:
                    await r.aread()
                    return r.status_code, _json(r), None
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = _loads(data)
                    if not isinstance(chunk, dict):
                        continue
                    for key in ("id", "model", "usage"):
                        if chunk.get(key) is not None:
                            payload[key] = chunk[key]
                    for choice in chunk.get("choices") or []:
                        if ttft is None:
                            ttft = time.monotonic() - t0
                        delta = choice.get("delta") or {}
                        role = delta.get("role") or role
                        if delta.get("content"):
                            content.append(str(delta["content"]))
                        if choice.get("finish_reason"):
                            reasons[int(choice.get("index", 0))] = str(choice["finish_reason"])
        except httpx.TimeoutException as exc:
            raise TimeoutError_(f"POST {path} timed out: {exc}") from exc
        except httpx.TransportError as exc:
            raise TransportError(f"POST {path} failed: {exc!r}") from exc
        payload["choices"] = [
            {
                "index": 0,
                "message": {"role": role, "content": "".join(content)},
                "finish_reason": reasons.get(0),
            }
        ]
        return 200, payload, ttft

    def degrade(self, why: str) -> None:
        if self.routes is not False:
            self.routes = False
            warnings.warn(
                f"agentkv routes unavailable ({why}); pause/resume/close are skipped",
                DegradedWarning,
                stacklevel=4,
            )
            log.warning("harness_sdk: agentkv routes unavailable (%s)", why)

    def check_pause_reply(self, branch: str, reply: dict[str, Any] | None) -> None:
        """Warn (once per trajectory) when the engine did not apply a pause decision."""
        if reply is None or reply.get("applied") is not False or self.warned_pause_not_applied:
            return
        self.warned_pause_not_applied = True
        decision = reply.get("decision")
        action = decision.get("action") if isinstance(decision, dict) else None
        why = ", ".join(
            f"{key}={reply[key]!r}"
            for key in ("state", "reason", "detail")
            if reply.get(key) is not None
        )
        msg = (
            f"the engine did not apply the pause decision"
            f"{f' ({action})' if action else ''} for trajectory {self.trajectory_id!r} "
            f"branch {reply.get('branch') or branch!r}"
            f"{f' ({why})' if why else ''}: the KV is not (yet) where the decision puts it; "
            "see server_state(). Warned once per trajectory"
        )
        warnings.warn(msg, PauseNotAppliedWarning, stacklevel=3)
        log.warning("harness_sdk: %s", msg)

    async def control(
        self, method: str, path: str, json: Any = None, *, quiet: bool = True
    ) -> dict[str, Any] | None:
        """Call an agentkv route. None when the routes are absent or the trajectory is unknown.

        Raises AuthenticationError always; other failures raise only when ``quiet`` is False.
        """
        if self.routes is False:
            return None
        try:
            r = await self.request(method, "/agentkv/v1" + path, json)
        except TransportError as exc:
            if not quiet:
                raise
            log.warning("harness_sdk: %s %s failed: %s", method, path, exc)
            return None
        body = _json(r)
        if r.status_code < 400:
            self.routes = True
            return body if isinstance(body, dict) else {"body": body}
        detail = body.get("detail") if isinstance(body, dict) else None
        if r.status_code in (405, 501, 503) or (
            r.status_code == 404 and detail in (None, "Not Found")
        ):
            self.degrade(f"{r.status_code} {detail or r.text[:80]}")
            return None
        err = status_error(r.status_code, body, str(r.request.url))
        if isinstance(err, AuthenticationError) or not quiet:
            raise err
        if r.status_code != 404:
            log.warning("harness_sdk: %s", err)
        return None

    async def aclose(self) -> None:
        if self.owns_client:
            await self.client.aclose()


def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return {"detail": r.text[:500]}


def _loads(data: str) -> Any:
    try:
        return jsonlib.loads(data)
    except ValueError:
        return None


def _normalize_base(url: str) -> str:
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"base_url must start with http:// or https://, got {url!r}")
    return url


def _first_divergence(expected: list[dict[str, Any]], actual: list[dict[str, Any]]) -> int | None:
    for i, (a, b) in enumerate(zip(expected, actual, strict=False)):
        if a != b:
            return i
    return None if len(actual) >= len(expected) else len(actual)


class ToolHost(Protocol):
    """What a ToolWait needs from its owner: a Trajectory, or a wrapped OpenAI client
    (``harness_sdk.openai``)."""

    _shared: _Shared
    branch: str
    tool_waits: list[ToolWait]

    def _check_open(self) -> None: ...

    def observe(self, content: str, role: str = "user") -> None: ...


class ToolWait:
    """``async with traj.tool(name, expected_s=...)``: pause on enter, resume on exit.

    ``decision`` holds the server's pause decision (None when skipped), ``duration_s`` the
    measured wait. Exceptions in the body propagate after the resume.
    """

    def __init__(self, traj: ToolHost, name: str, expected_s: float | None) -> None:
        if not name or len(name) > 128:
            raise ConfigError("tool name must be 1-128 characters")
        if expected_s is not None and expected_s < 0:
            raise ConfigError("expected_s must be >= 0")
        self.traj = traj
        self.name = name
        self.expected_s = expected_s
        self.pause_response: dict[str, Any] | None = None
        self.resume_response: dict[str, Any] | None = None
        self.duration_s: float | None = None
        self.error: BaseException | None = None
        self._stack = contextlib.ExitStack()
        self._t0 = 0.0

    @property
    def decision(self) -> dict[str, Any] | None:
        d = (self.pause_response or {}).get("decision")
        return d if isinstance(d, dict) else None

    def observe(self, content: str, role: str = "user") -> None:
        """Add the tool's output to the trajectory's observation zone."""
        self.traj.observe(f"[{self.name}] {content}", role=role)

    async def __aenter__(self) -> ToolWait:
        self.traj._check_open()
        shared = self.traj._shared
        span = self._stack.enter_context(
            shared.telemetry.tool_span(
                tool=self.name,
                expected_s=self.expected_s,
                trajectory_id=shared.trajectory_id,
                branch=self.traj.branch,
            )
        )
        self._span = span
        try:
            self.pause_response = await shared.control(
                "POST",
                f"/trajectories/{shared.trajectory_id}/pause",
                {"tool": self.name, "expected_wait_s": self.expected_s, "branch": self.traj.branch},
            )
        except BaseException as exc:
            self._stack.__exit__(type(exc), exc, exc.__traceback__)
            raise
        shared.check_pause_reply(self.traj.branch, self.pause_response)
        if self.decision is not None:
            span.set_attribute(ATTR_PAUSE_ACTION, str(self.decision.get("action")))
            span.set_attribute(
                ATTR_PAUSE_APPLIED, bool(self.pause_response and self.pause_response.get("applied"))
            )
        self._t0 = time.monotonic()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.duration_s = time.monotonic() - self._t0
        self.error = exc
        shared = self.traj._shared
        try:
            if self.pause_response is not None and not shared.closed:
                self.resume_response = await shared.control(
                    "POST",
                    f"/trajectories/{shared.trajectory_id}/resume",
                    {"branch": self.traj.branch},
                )
        except Exception as resume_exc:  # a failed resume must not hide the tool's own error
            if exc is None:
                log.warning("harness_sdk: resume after %s failed: %s", self.name, resume_exc)
        finally:
            shared.telemetry.record_tool_wait(
                self._span, tool=self.name, duration_s=self.duration_s, error=exc
            )
            self._stack.__exit__(exc_type, exc, tb)
        self.traj.tool_waits.append(self)


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
    ) -> None:
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

    # --- properties --------------------------------------------------------------------------
    @property
    def trajectory_id(self) -> str:
        return self._shared.trajectory_id

    @property
    def model(self) -> str:
        return self._shared.model

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
    ) -> TurnResult:
        """Send one turn (``user`` is added to the observation first) and commit the reply.

        ``stream=True`` sends an SSE request with ``stream_options.include_usage`` and sets
        ``TurnResult.ttft_s``. vLLM returns the agentkv per-turn stats only in non-streamed
        responses, so a streamed turn has ``engine`` None (``server_state()`` still has them).
        """
        self._check_open()
        if user is not None:
            self.observe(user)
        shared = self._shared
        rendered = self.context.render()
        if not rendered.messages:
            raise LayoutError("nothing to send: the context is empty")
        turn = self._turn + 1
        changes = [ZoneChange(c.zone, c.diff, turn) for c in check_stability(self._last, rendered)]
        for c in changes:
            warnings.warn(str(c), StableZoneChangedWarning, stacklevel=2)
            log.warning("harness_sdk: %s", c)
        lint = lint_context(rendered)
        for finding in lint:
            if finding not in shared.seen_lint:
                shared.seen_lint.add(finding)
                warnings.warn(
                    f"volatile data in stable zone {finding}", VolatileContentWarning, stacklevel=2
                )
        divergence: int | None = None
        if self._last is not None and self._last_reply is not None:
            divergence = _first_divergence(
                [*self._last.messages, self._last_reply], rendered.messages
            )
        div_zone = rendered.zone_of_message(divergence) if divergence is not None else None
        mt = max_tokens if max_tokens is not None else self.max_tokens
        temp = temperature if temperature is not None else self.temperature
        body = shared.adapter.build_request(
            rendered,
            model=shared.model,
            trajectory_id=shared.trajectory_id,
            branch=self.branch,
            max_tokens=mt,
            temperature=temp,
            extra=extra_body,
        )
        tel = shared.telemetry
        with tel.turn_span(
            model=shared.model,
            provider=shared.adapter.provider,
            trajectory_id=shared.trajectory_id,
            branch=self.branch,
            turn=turn,
            max_tokens=mt,
            temperature=temp,
            server=shared.server,
        ) as span:
            ttft: float | None = None
            t0 = time.monotonic()
            if stream:
                body = {**body, "stream": True, "stream_options": {"include_usage": True}}
                status, payload, ttft = await shared.stream_chat(
                    shared.adapter.path,
                    body,
                    shared.session_headers(shared.adapter.headers(shared.api_key)),
                )
                latency = time.monotonic() - t0
                if status >= 400:
                    raise status_error(status, payload, shared.base_url + shared.adapter.path)
            else:
                r = await shared.request("POST", shared.adapter.path, body)
                latency = time.monotonic() - t0
                payload = _json(r)
                if r.status_code >= 400:
                    raise status_error(r.status_code, payload, str(r.request.url))
            parsed = shared.adapter.parse_response(payload if isinstance(payload, dict) else {})
            result = TurnResult(
                shared.trajectory_id,
                self.branch,
                turn,
                parsed.content,
                parsed.message,
                parsed.usage,
                parsed.engine,
                changes,
                lint,
                divergence,
                div_zone,
                latency,
                parsed.finish_reasons,
                payload,
                ttft,
            )
            tel.record_turn(
                span,
                model=shared.model,
                provider=shared.adapter.provider,
                trajectory_id=shared.trajectory_id,
                branch=self.branch,
                input_tokens=parsed.usage.input_tokens,
                output_tokens=parsed.usage.output_tokens,
                cached_tokens=parsed.usage.cached_tokens,
                cache_creation_tokens=parsed.usage.cache_creation_tokens,
                hit_ratio=result.hit_ratio,
                engine=parsed.engine,
                response_model=parsed.response_model,
                response_id=parsed.response_id,
                finish_reasons=parsed.finish_reasons,
                zone_changes=[(c.zone, c.diff) for c in changes],
                lint=[str(f) for f in lint],
                client_divergence_message=divergence,
            )
        self._last, self._last_reply = rendered, parsed.message
        self.context.commit_turn(parsed.message)
        self._turn = turn
        self.results.append(result)
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
        return await self._shared.control("GET", f"/trajectories/{self.trajectory_id}")

    async def server_status(self) -> dict[str, Any] | None:
        """GET /agentkv/v1/status (None if the routes are absent)."""
        return await self._shared.control("GET", "/status")

    async def close(self) -> dict[str, Any] | None:
        """Root: DELETE the trajectory (all branches, every tier) and close the HTTP client.
        Branch: prune it. Idempotent. Returns the server's release counts when it answered."""
        if self.parent is not None:
            if not self.pruned:
                self.prune()
            return None
        if self._shared.closed:
            return None
        self._shared.closed = True
        try:
            if self._turn or self.children:
                return await self._shared.control("DELETE", f"/trajectories/{self.trajectory_id}")
            return None
        finally:
            await self._shared.aclose()

    async def __aenter__(self) -> Trajectory:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


@contextlib.contextmanager
def run_tool_wait(loop: asyncio.AbstractEventLoop, wait: ToolWait) -> Iterator[ToolWait]:
    """Enter and exit an async ToolWait from blocking code, on ``loop``.

    Both halves run in one contextvars context: the tool span's OTel context token is attached
    on enter and detached on exit, and two tasks with a context copy each would make the detach
    fail ("was created in a different Context"). Python 3.10 has no ``create_task(context=)``;
    there the detach error is only logged by OTel.
    """
    ctx = contextvars.copy_context()

    def run(coro: Any) -> Any:
        if sys.version_info >= (3, 11):
            return loop.run_until_complete(loop.create_task(coro, context=ctx))
        return loop.run_until_complete(coro)  # pragma: no cover

    run(wait.__aenter__())
    try:
        yield wait
    except BaseException as exc:
        run(wait.__aexit__(type(exc), exc, exc.__traceback__))
        raise
    run(wait.__aexit__(None, None, None))


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
