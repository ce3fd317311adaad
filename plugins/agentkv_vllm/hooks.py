"""Tool-wait hooks with no client changes: trajectory identity from session hints, and an
automatic pause when a trajectory's chat completion returns tool calls.

vLLM's engine sees only a request's ``kv_transfer_params``; headers and the tool-call parser live
in the API server process. So this is a raw ASGI middleware on the OpenAI server
(``AgentKVRoutes.attach_router`` installs it) for ``POST /v1/chat/completions`` and
``POST /v1/completions``:

1. **Identity.** When the body carries no ``kv_transfer_params.agentkv``, the trajectory id comes
   from a session hint, and ``kv_transfer_params = {"agentkv": {"trajectory_id": ...}}`` is
   written into the JSON body before vLLM parses it (``Content-Length`` fixed). The first hint
   present decides, in this order:

   1. ``kv_transfer_params.agentkv`` (the explicit contract; left untouched)
   2. the body's ``session_id`` (vLLM 0.32's own session field)
   3. the ``x-session-id`` header
   4. ``vllm_xargs.agentic_context`` (vllm-router: a JSON string) ``.session_id``
   5. ``vllm_xargs.session_id``

   A hint-named trajectory uses branch ``main``. An id outside ``agentkv.ids``'s grammar, or an
   ``agentic_context`` that is not a JSON object, makes the request vanilla (served as is), with
   one warning per distinct problem (not per request); a lower hint is not tried instead.
   ``agentic_context.expected_resume`` (seconds) becomes the auto-pause's declared wait,
   whichever hint named the trajectory; ``kv_retention_ttl_seconds`` caps the lease of a
   retain decision (the pause's ``max_lease_s``).

2. **Auto-pause.** When the response of a trajectory's chat completion has tool calls
   (non-streamed: ``choices[].message.tool_calls``; streamed: ``choices[].delta.tool_calls`` in
   the SSE chunks), the middleware asks the engine to pause that branch with ``tool`` = the first
   called function's name (the API server cannot see per-tool predictions cheaply) and
   ``expected_wait_s`` = the declared ``expected_resume`` or None (the engine's learned per-tool
   wait). The pause is sent *before* the response's last bytes (the body of a JSON response, the
   ``data: [DONE]`` event of a stream) go out, so a client's own pause or resume, which can only
   follow the response, always comes later and overrides it. The engine observes the resume at
   the trajectory's next request, so its per-tool predictor learns with no client code.

Nothing here may fail a request: any exception in the middleware's own work passes the request
through untouched (or lets the response finish) and is logged. No vllm import.

Primitives:
  HookState            process-wide switches (``enabled``, ``auto_pause``), the pause callable,
                       counters, the warn-once set
  Identity             a request's trajectory, where it came from, declared wait and lease cap
  resolve_identity(body, headers) -> (Identity | None, [Problem])     pure
  inject_identity(raw, body, identity) -> bytes                       the rewritten body
  tool_names_from_json(raw) / SSEToolScanner                          tool calls in a response
  AgentKVHooks(app, state)                                            the ASGI middleware
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from agentkv.ids import MAX_ID_LEN, is_valid_id
from agentkv_vllm.params import parse_request_params

log = logging.getLogger("agentkv.hooks")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PauseFn = Callable[[str, str, str, float | None, float | None], Awaitable[None]]
"""``await pause(trajectory_id, branch, tool, expected_wait_s, lease_cap_s)``."""

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
PATHS = frozenset({CHAT_PATH, COMPLETIONS_PATH})
SESSION_HEADER = b"x-session-id"
DEFAULT_BRANCH = "main"
# Sources, in precedence order (the names used in warnings, counters and docs).
SRC_PARAMS = "kv_transfer_params"
SRC_BODY = "session_id"
SRC_HEADER = "x-session-id"
SRC_CONTEXT = "agentic_context"
SRC_XARGS = "vllm_xargs.session_id"
SOURCES = (SRC_PARAMS, SRC_BODY, SRC_HEADER, SRC_CONTEXT, SRC_XARGS)
# Bytes whose absence from a body proves it carries no hint / no explicit params (no JSON parse).
_HINT_MARKERS = (b'"session_id"', b'"agentic_context"')
_PARAMS_MARKER = b'"agentkv"'
MAX_TOOL_NAME = 128  # what the pause route accepts
MAX_JSON_RESPONSE = 32 * 1024 * 1024  # larger non-streamed responses are not inspected
MAX_SSE_LINE = 4 * 1024 * 1024
PAUSE_TIMEOUT_S = 2.0
MAX_WARNED = 256


@dataclass(frozen=True)
class Problem:
    """One malformed hint: ``key`` (source, kind) is what warn-once dedupes on."""

    source: str
    kind: str
    message: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.source, self.kind)


@dataclass(frozen=True)
class Identity:
    trajectory_id: str
    branch: str
    source: str
    inject: bool
    """True when the body must be rewritten (the id came from a hint, not from the params)."""
    expected_wait_s: float | None = None
    lease_cap_s: float | None = None


@dataclass
class HookState:
    """What the middleware reads at request time (set by the routes' ``init_state``)."""

    enabled: bool = False
    auto_pause: bool = True
    pause: PauseFn | None = None
    pause_timeout_s: float = PAUSE_TIMEOUT_S
    counters: Counter[str] = field(default_factory=Counter)
    warned: set[tuple[str, str]] = field(default_factory=set)

    def warn_once(self, problem: Problem) -> None:
        self.counters[f"malformed.{problem.source}"] += 1
        if problem.key in self.warned or len(self.warned) >= MAX_WARNED:
            return
        self.warned.add(problem.key)
        log.warning(
            "agentkv: %s; the request is served as vanilla vLLM (warned once per kind of problem)",
            problem.message,
        )

    def view(self) -> dict[str, Any]:
        """For ``GET /agentkv/v1/status`` (``hooks``)."""
        return {
            "enabled": self.enabled,
            "auto_pause": self.auto_pause,
            "precedence": list(SOURCES),
            "counters": dict(sorted(self.counters.items())),
        }


# ---------------------------------------------------------------------------------- identity


def _id_problem(value: object) -> str:
    if not isinstance(value, str):
        return "type"
    if not value:
        return "empty"
    if len(value) > MAX_ID_LEN:
        return "length"
    if value in (".", ".."):
        return "dots"
    return "character"


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 66 else text[:64] + "..."


def _seconds(value: object) -> float | None:
    """A non-negative finite number of seconds (a number or a numeric string), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return None
    if isinstance(value, (int, float)):
        v = float(value)
        if math.isfinite(v) and v >= 0:
            return v
    return None


def _agentic_context(xargs: object, problems: list[Problem]) -> dict[str, Any] | None:
    if not isinstance(xargs, dict) or "agentic_context" not in xargs:
        return None
    raw = xargs["agentic_context"]
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            ctx = json.loads(raw)
        except ValueError as exc:
            problems.append(
                Problem(SRC_CONTEXT, "json", f"vllm_xargs.agentic_context is not JSON ({exc})")
            )
            return None
        if isinstance(ctx, dict):
            return ctx
    problems.append(
        Problem(
            SRC_CONTEXT,
            "type",
            "vllm_xargs.agentic_context must be a JSON object (as a string), "
            f"got {type(raw).__name__}",
        )
    )
    return None


def _context_seconds(
    ctx: Mapping[str, Any] | None, key: str, problems: list[Problem]
) -> float | None:
    if ctx is None or ctx.get(key) is None:
        return None
    value = _seconds(ctx[key])
    if value is None:
        problems.append(
            Problem(
                SRC_CONTEXT,
                key,
                f"vllm_xargs.agentic_context.{key} {_shown(ctx[key])} is not a number of "
                "seconds >= 0; ignored",
            )
        )
    return value


def resolve_identity(
    body: Any, headers: Mapping[str, str]
) -> tuple[Identity | None, list[Problem]]:
    """The trajectory a request belongs to, and the malformed hints met on the way. Pure.

    ``headers``: lower-case names. Explicit params are not validated here (the engine does, and
    warns): a malformed ``kv_transfer_params.agentkv`` is a vanilla request, as before.
    """
    problems: list[Problem] = []
    if not isinstance(body, dict):
        return None, problems
    ktp = body.get("kv_transfer_params")
    if ktp is not None and not isinstance(ktp, dict):
        return None, problems  # vLLM answers 400 itself
    xargs = body.get("vllm_xargs")
    ctx = _agentic_context(xargs, problems)
    wait = _context_seconds(ctx, "expected_resume", problems)
    ttl = _context_seconds(ctx, "kv_retention_ttl_seconds", problems)
    if isinstance(ktp, dict) and ktp.get("agentkv") is not None:
        params = parse_request_params(ktp).params
        if params is None:
            return None, problems
        return Identity(params.trajectory_id, params.branch, SRC_PARAMS, False, wait, ttl), problems

    candidates: list[tuple[str, object]] = []
    if body.get("session_id") is not None:
        candidates.append((SRC_BODY, body["session_id"]))
    if SRC_HEADER in headers:
        candidates.append((SRC_HEADER, headers[SRC_HEADER]))
    if ctx is not None and ctx.get("session_id") is not None:
        candidates.append((SRC_CONTEXT, ctx["session_id"]))
    if isinstance(xargs, dict) and xargs.get("session_id") is not None:
        candidates.append((SRC_XARGS, xargs["session_id"]))
    if not candidates:
        return None, problems
    source, value = candidates[0]
    if not is_valid_id(value):
        what = {SRC_CONTEXT: "vllm_xargs.agentic_context.session_id"}.get(source, source)
        problems.append(
            Problem(
                source,
                _id_problem(value),
                f"{what} {_shown(value)} is not a trajectory id (1-{MAX_ID_LEN} characters "
                "from A-Z a-z 0-9 . _ : @ -, not '.' or '..')",
            )
        )
        return None, problems
    assert isinstance(value, str)
    return Identity(value, DEFAULT_BRANCH, source, True, wait, ttl), problems


def might_carry_hint(raw: bytes, headers: Mapping[str, str]) -> bool:
    """False when neither the header nor a hint's key is present: no hint, no parse needed."""
    return SRC_HEADER in headers or any(m in raw for m in _HINT_MARKERS)


def might_carry_params(raw: bytes) -> bool:
    """False when the body cannot hold ``kv_transfer_params.agentkv``."""
    return _PARAMS_MARKER in raw


def resolve_deferred(raw: bytes) -> Identity | None:
    """The identity of a body with explicit params and no hint; parsed only when needed."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return resolve_identity(body, {})[0]


def inject_identity(raw: bytes, body: dict[str, Any], identity: Identity) -> bytes:
    """``raw`` with ``kv_transfer_params.agentkv = {trajectory_id, branch}`` added.

    Without ``kv_transfer_params`` in the body the member is spliced in before the closing brace
    (the rest of the bytes stay as sent); with one (another connector's keys) the body is
    re-serialized with the keys merged.
    """
    agentkv = {"trajectory_id": identity.trajectory_id, "branch": identity.branch}
    if body.get("kv_transfer_params") is None and "kv_transfer_params" not in body:
        member = json.dumps({"agentkv": agentkv}, separators=(",", ":")).encode()
        stripped = raw.rstrip()
        if stripped.endswith(b"}"):
            head = stripped[:-1].rstrip()
            sep = b"" if head.endswith(b"{") else b","
            return head + sep + b'"kv_transfer_params":' + member + b"}"
    merged = dict(body)
    merged["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}), "agentkv": agentkv}
    return json.dumps(merged, separators=(",", ":"), ensure_ascii=False).encode()


# ---------------------------------------------------------------------------------- tool calls


def _names_in(calls: object) -> Iterable[str]:
    if not isinstance(calls, list):
        return
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if isinstance(name, str) and name:
            yield name


def tool_names_from_payload(payload: object, key: str) -> list[str]:
    """Function names in ``choices[].<key>.tool_calls`` (key: "message" or "delta")."""
    names: list[str] = []
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list):
        return names
    for choice in choices:
        part = choice.get(key) if isinstance(choice, dict) else None
        if isinstance(part, dict):
            names.extend(_names_in(part.get("tool_calls")))
    return names


def tool_names_from_json(raw: bytes) -> list[str]:
    """Tool calls of a non-streamed chat completion; [] for anything else."""
    if b"tool_calls" not in raw:
        return []
    try:
        payload = json.loads(raw)
    except ValueError:
        return []
    return tool_names_from_payload(payload, "message")


class SSEToolScanner:
    """Feeds on a chat completion's SSE bytes; collects tool names, notices ``data: [DONE]``."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.done = False
        self._buf = b""

    def feed(self, chunk: bytes) -> None:
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        if len(self._buf) > MAX_SSE_LINE:  # not SSE as vLLM writes it; stop looking
            self._buf = b""
        for line in lines:
            self._line(line.rstrip(b"\r"))

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        if b"tool_calls" not in data:
            return
        try:
            payload = json.loads(data)
        except ValueError:
            return
        self.names.extend(tool_names_from_payload(payload, "delta"))


# ---------------------------------------------------------------------------------- middleware


def _headers(scope: Scope) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in scope.get("headers") or ():
        name = k.decode("latin-1").lower()
        if name not in out:
            out[name] = v.decode("latin-1")
    return out


def _with_length(scope: Scope, length: int) -> Scope:
    new = dict(scope)
    headers = [(k, v) for k, v in scope.get("headers") or () if k.lower() != b"content-length"]
    chunked = any(k.lower() == b"transfer-encoding" and b"chunked" in v.lower() for k, v in headers)
    if not chunked:
        headers.append((b"content-length", str(length).encode()))
    new["headers"] = headers
    return new


def _route_path(scope: Scope) -> str:
    path = str(scope.get("path") or "")
    root = str(scope.get("root_path") or "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path


class AgentKVHooks:
    """Raw ASGI middleware; see the module docstring."""

    def __init__(self, app: ASGIApp, state: HookState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope.get("type") != "http"
            or scope.get("method") != "POST"
            or not self.state.enabled
            or _route_path(scope) not in PATHS
        ):
            await self.app(scope, receive, send)
            return
        # Read the whole body (vLLM reads it all too), keeping every message to replay it.
        messages: list[Message] = []
        while True:
            message = await receive()
            messages.append(message)
            if message.get("type") != "http.request" or not message.get("more_body", False):
                break
        identity: Identity | bytes | None = None
        try:
            if messages[-1].get("type") == "http.request":
                raw = b"".join(m.get("body", b"") for m in messages)
                identity, new_raw = self._identify(scope, raw)
                if new_raw is not None:
                    scope = _with_length(scope, len(new_raw))
                    messages = [{"type": "http.request", "body": new_raw, "more_body": False}]
        except Exception:
            log.exception("agentkv: session hook failed; the request is served untouched")
            identity = None
        replay = _Replay(messages, receive)
        if (
            identity is None
            or not self.state.auto_pause
            or self.state.pause is None
            or _route_path(scope) != CHAT_PATH
        ):
            await self.app(scope, replay, send)
            return
        watcher = _ResponseWatcher(self.state, identity, send)
        await self.app(scope, replay, watcher.send)

    def _identify(self, scope: Scope, raw: bytes) -> tuple[Identity | bytes | None, bytes | None]:
        """(identity, rewritten body or None). The identity is ``raw`` itself (deferred) for a
        body with explicit params and no hint: its ids are parsed only if the reply has tool
        calls, so plain trajectory requests cost a substring search, not a JSON parse."""
        headers = _headers(scope)
        if not might_carry_hint(raw, headers):
            return (raw if might_carry_params(raw) else None), None
        try:
            body = json.loads(raw)
        except ValueError:
            return None, None  # vLLM answers the bad JSON itself
        identity, problems = resolve_identity(body, headers)
        for p in problems:
            self.state.warn_once(p)
        if identity is None:
            return None, None
        if not identity.inject:
            return identity, None
        self.state.counters[f"identified.{identity.source}"] += 1
        return identity, inject_identity(raw, body, identity)


class _Replay:
    """``receive`` that returns the buffered request messages, then the live channel (which
    carries ``http.disconnect`` when the client goes away)."""

    def __init__(self, messages: list[Message], receive: Receive) -> None:
        self._messages = list(messages)
        self._receive = receive

    async def __call__(self) -> Message:
        if self._messages:
            return self._messages.pop(0)
        return await self._receive()


class _ResponseWatcher:
    """Wraps ``send``: spots tool calls in a 200 response and pauses before its last bytes."""

    def __init__(self, state: HookState, identity: Identity | bytes, send: Send) -> None:
        self.state = state
        self.identity = identity
        self._send = send
        self._status = 0
        self._sse = False
        self._json = bytearray()
        self._json_overflow = False
        self._scanner = SSEToolScanner()
        self._fired = False

    async def send(self, message: Message) -> None:
        try:
            await self._observe(message)
        except Exception:
            log.exception("agentkv: auto-pause hook failed; the response is sent as is")
            self._fired = True
        await self._send(message)

    async def _observe(self, message: Message) -> None:
        kind = message.get("type")
        if kind == "http.response.start":
            self._status = int(message.get("status", 0))
            for k, v in message.get("headers") or ():
                if k.lower() == b"content-type" and b"text/event-stream" in v.lower():
                    self._sse = True
            return
        if kind != "http.response.body" or self._fired or self._status != 200:
            return
        chunk = bytes(message.get("body", b""))
        last = not message.get("more_body", False)
        if self._sse:
            self._scanner.feed(chunk)
            if self._scanner.done or last:
                await self._fire(self._scanner.names)
            return
        if not self._json_overflow:
            if len(self._json) + len(chunk) > MAX_JSON_RESPONSE:
                self._json_overflow = True
                self._json.clear()
            else:
                self._json += chunk
        if last:
            await self._fire([] if self._json_overflow else tool_names_from_json(bytes(self._json)))

    async def _fire(self, names: list[str]) -> None:
        self._fired = True
        if not names or self.state.pause is None:
            return
        ident = (
            resolve_deferred(self.identity) if isinstance(self.identity, bytes) else self.identity
        )
        if ident is None:
            return
        tool = names[0][:MAX_TOOL_NAME]
        self.state.counters["tool_call_responses"] += 1
        try:
            await asyncio.wait_for(
                self.state.pause(
                    ident.trajectory_id,
                    ident.branch,
                    tool,
                    ident.expected_wait_s,
                    ident.lease_cap_s,
                ),
                timeout=self.state.pause_timeout_s,
            )
            self.state.counters["auto_pauses"] += 1
        except Exception as exc:
            self.state.counters["auto_pause_failed"] += 1
            log.warning(
                "agentkv: auto-pause of %s/%s (tool %s) failed: %r",
                ident.trajectory_id,
                ident.branch,
                tool,
                exc,
            )


__all__ = [
    "PATHS",
    "SOURCES",
    "AgentKVHooks",
    "HookState",
    "Identity",
    "Problem",
    "SSEToolScanner",
    "inject_identity",
    "might_carry_hint",
    "might_carry_params",
    "resolve_deferred",
    "resolve_identity",
    "tool_names_from_json",
    "tool_names_from_payload",
]
