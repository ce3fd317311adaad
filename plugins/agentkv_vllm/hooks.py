"""Tool-wait hooks with no client changes: trajectory identity from session hints (or a
Responses chain), an automatic pause when a trajectory's reply calls tools, and the reason a
request was served as vanilla.

vLLM's engine sees only a request's ``kv_transfer_params``; headers and the tool-call parsers
live in the API server process. So this is a raw ASGI middleware on the OpenAI server
(``AgentKVRoutes.attach_router`` installs it) for ``POST`` on ``/v1/chat/completions``,
``/v1/completions``, ``/v1/responses`` (OpenAI Responses) and ``/v1/messages`` (Anthropic
Messages):

1. **Identity** (``agentkv_vllm.identity``): when the body carries no
   ``kv_transfer_params.agentkv``, the trajectory id comes from a session hint (body
   ``session_id``, ``x-session-id``, vllm-router's ``agentic_context``, ``vllm_xargs``,
   OpenAI's ``prompt_cache_key``) or, on ``/v1/responses`` with a response store, from the
   ``previous_response_id`` chain, and ``kv_transfer_params = {"agentkv": {"trajectory_id":
   ...}}`` is written into the JSON body before vLLM parses it (``Content-Length`` fixed).
   Malformed hints make the request vanilla, with one warning per distinct problem. The reply
   says which hint named it: an ``x-agentkv-identified-by`` header, and ``identified_by`` in a
   JSON reply's agentkv stats.

2. **Auto-pause.** When the reply of a trajectory's request calls tools (``agentkv_vllm
   .tool_calls`` knows where each API puts them, JSON and SSE), the middleware asks the engine
   to pause that branch with the list of called tools (the engine predicts the wait of the one
   it expects to take longest: parallel calls end when the slowest does) and
   ``expected_wait_s`` = the declared ``expected_resume`` or None (the engine's learned
   per-tool wait). The pause is sent *before* the response's last bytes (the body of a JSON
   response; ``data: [DONE]``, ``response.completed`` or ``message_stop`` of a stream), so a
   client's own pause or resume, which can only follow the response, always comes later and
   overrides it. The engine observes the resume at the trajectory's next request, so its
   per-tool predictor learns with no client code. A Responses reply's id is recorded in the
   chain table (``agentkv_vllm.chains``), so the next request naming it continues the
   trajectory; and the digest of its whole conversation (request input, then output) in the
   prefix index (``agentkv_vllm.prefixes``), so a next request without ``previous_response_id``
   that resends that conversation (the Agents SDK's default) continues it too, unless the
   engine no longer holds the trajectory (DELETEd, expired).

3. **Tenants of stored responses.** vLLM's response store has no tenants: it serves a stored
   response to anyone who names its id (``GET /v1/responses/{id}``, ``.../cancel``) and renders
   the conversation a ``previous_response_id`` names into the new prompt. The chain table keeps
   each response's tenant (its request's ``cache_salt``), and a request of another tenant naming
   a salted response gets vLLM's own 404 ("not found"), before vLLM sees it. The GET names its
   tenant in the ``X-AgentKV-Cache-Salt`` header or a ``cache_salt`` query parameter.

4. **Why vanilla.** A request whose agentkv params or hint are malformed is served as vanilla
   vLLM, and the response says why: ``kv_transfer_params.agentkv.error`` in a JSON reply (the
   same text as the server log), and an ``x-agentkv-error`` header (streams too).

Nothing here may fail a request: any exception in the middleware's own work passes the request
through untouched (or lets the response finish) and is logged. No vllm import.

Primitives:
  HookState            process-wide switches (``enabled``, ``auto_pause``, ``responses_chains``),
                       the pause callable, the chain table, counters, the warn-once set
  AgentKVHooks(app, state)                                            the ASGI middleware
  (re-exported) Identity, Problem, resolve_identity, inject_identity, might_carry_hint,
  might_carry_params, resolve_deferred; SSEToolScanner, tool_names_from_json
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from agentkv.ids import TENANT_FIELD, TENANT_HEADER
from agentkv_vllm.chains import ResponseChains
from agentkv_vllm.identity import (
    SOURCES,
    SRC_CHAIN,
    Identity,
    Problem,
    foreign_chain,
    inject_identity,
    might_carry_hint,
    might_carry_params,
    params_error,
    request_salt,
    resolve_deferred,
    resolve_identity,
)
from agentkv_vllm.prefixes import (
    ConversationPrefixes,
    continued,
    conversation_digests,
    extend,
)
from agentkv_vllm.tool_calls import Api, SSEToolScanner, tool_names_from_json

log = logging.getLogger("agentkv.hooks")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# (trajectory id, branch, tools, expected wait, lease cap[, cache_salt: only when the request
# named one -- the trajectory's tenant])
PauseFn = Callable[..., Awaitable[None]]
"""``await pause(trajectory_id, branch, tools, expected_wait_s, lease_cap_s)``; ``tools``: the
called tools' names in reply order, at least one."""

PATHS = frozenset(a.value for a in Api)
PAUSE_APIS = frozenset({Api.CHAT, Api.RESPONSES, Api.MESSAGES})
ERROR_HEADER = b"x-agentkv-error"
# Which hint named the trajectory (an ``identity.SOURCES`` name), on every reply of a request a
# hint named; a JSON reply's agentkv stats carry it as ``identified_by`` too.
IDENTIFIED_HEADER = b"x-agentkv-identified-by"
IDENTIFIED_FIELD = "identified_by"
MAX_TOOL_NAME = 128  # what the pause route accepts
MAX_TOOLS = 64
MAX_ERROR_HEADER = 512
MAX_JSON_RESPONSE = 32 * 1024 * 1024  # larger non-streamed responses are not inspected
PAUSE_TIMEOUT_S = 2.0
MAX_WARNED = 256
# vLLM's routes that read one stored response by id (retrieve, cancel).
STORED_RESPONSE = re.compile(r"^/v1/responses/([^/]+)(?:/cancel)?/?$")


@dataclass
class HookState:
    """What the middleware reads at request time (set by the routes' ``init_state``)."""

    enabled: bool = False
    auto_pause: bool = True
    responses_chains: bool = False
    """``/v1/responses`` requests without a hint follow their chain (the server stores
    responses: ``VLLM_ENABLE_RESPONSES_API_STORE=1``)."""
    pause: PauseFn | None = None
    pause_timeout_s: float = PAUSE_TIMEOUT_S
    before_metrics: Callable[[], Awaitable[None]] | None = None
    """Awaited before a ``GET /metrics`` reaches vLLM (``MetricsSnapshot.refresh``)."""
    chains: ResponseChains = field(default_factory=ResponseChains)
    prefixes: ConversationPrefixes = field(default_factory=ConversationPrefixes)
    known: Callable[[str, str | None], Awaitable[bool]] | None = None
    """``await known(trajectory_id, cache_salt)``: whether an engine still holds it (a resent
    conversation never continues a DELETEd or expired trajectory)."""
    counters: Counter[str] = field(default_factory=Counter)
    warned: set[tuple[str, str]] = field(default_factory=set)

    def warn_once(self, problem: Problem) -> None:
        self.counters[f"malformed.{problem.source}"] += 1
        if problem.key in self.warned or len(self.warned) >= MAX_WARNED:
            return
        self.warned.add(problem.key)
        log.warning(
            "agentkv: %s; %s (warned once per kind of problem)",
            problem.message,
            "the request is served as vanilla vLLM"
            if problem.vanilla
            else "the request keeps its trajectory",
        )

    def view(self) -> dict[str, Any]:
        """For ``GET /agentkv/v1/status`` (``hooks``)."""
        return {
            "enabled": self.enabled,
            "auto_pause": self.auto_pause,
            "responses_chains": self.responses_chains,
            "precedence": list(SOURCES),
            "counters": dict(sorted(self.counters.items())),
        }


@dataclass
class _Identified:
    """What the request side learned: the identity (or the raw body, when parsing it is
    deferred to a reply that needs it), the rewritten body, why the request is vanilla."""

    identity: Identity | bytes | None = None
    new_raw: bytes | None = None
    error: str | None = None
    body: bytes = b""  # the request body: read again only if the reply would auto-pause
    salt: str | None = None  # the body's cache_salt (parsed Responses bodies only)
    refused: str | None = None  # another tenant's previous_response_id: answered 404 here
    conversation: bytes | None = None  # the digest of a Responses request's input (prefixes)


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


def _is_metrics_scrape(scope: Scope) -> bool:
    return (
        scope.get("type") == "http"
        and scope.get("method") == "GET"
        and _route_path(scope).rstrip("/") == "/metrics"
    )


class AgentKVHooks:
    """Raw ASGI middleware; see the module docstring."""

    def __init__(self, app: ASGIApp, state: HookState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.state.before_metrics is not None and _is_metrics_scrape(scope):
            await self.state.before_metrics()  # so the collector's sync fetch does not block
        if (foreign := self._foreign_stored(scope)) is not None:
            await _not_found(send, foreign)
            return
        if (
            scope.get("type") != "http"
            or scope.get("method") != "POST"
            or not self.state.enabled
            or _route_path(scope) not in PATHS
        ):
            await self.app(scope, receive, send)
            return
        api = Api(_route_path(scope))
        # Read the whole body (vLLM reads it all too), keeping every message to replay it.
        messages: list[Message] = []
        while True:
            message = await receive()
            messages.append(message)
            if message.get("type") != "http.request" or not message.get("more_body", False):
                break
        found = _Identified()
        try:
            if messages[-1].get("type") == "http.request":
                raw = b"".join(m.get("body", b"") for m in messages)
                found = await self._identify(scope, raw, api)
                found.body = raw
                if found.new_raw is not None:
                    scope = _with_length(scope, len(found.new_raw))
                    messages = [{"type": "http.request", "body": found.new_raw, "more_body": False}]
        except Exception:
            log.exception("agentkv: session hook failed; the request is served untouched")
            found = _Identified()
        if found.refused is not None:
            self.state.counters["foreign_chain_refused"] += 1
            await _not_found(send, found.refused)
            return
        replay = _Replay(messages, receive)
        if found.identity is None and found.error is None and found.salt is None:
            await self.app(scope, replay, send)
            return
        watcher = _ResponseWatcher(self.state, api, found, send)
        await self.app(scope, replay, watcher.send)

    def _foreign_stored(self, scope: Scope) -> str | None:
        """The response id of a ``GET /v1/responses/{id}`` (or its cancel) that another
        tenant's salted request produced; None: let vLLM answer."""
        if (
            scope.get("type") != "http"
            or not self.state.enabled
            or not self.state.responses_chains
            or scope.get("method") not in ("GET", "POST")
        ):
            return None
        path = _route_path(scope)
        match = STORED_RESPONSE.match(path)
        if match is None or (scope.get("method") == "POST") != path.rstrip("/").endswith("/cancel"):
            return None
        response_id = match.group(1)
        salt = _headers(scope).get(TENANT_HEADER.lower())
        if not salt:
            query = parse_qs(bytes(scope.get("query_string") or b"").decode("latin-1"))
            salt = next(iter(query.get(TENANT_FIELD) or ()), None)
        if not self.state.chains.foreign(response_id, salt):
            return None
        self.state.counters["foreign_response_refused"] += 1
        return response_id

    async def _identify(self, scope: Scope, raw: bytes, api: Api) -> _Identified:
        """The identity is ``raw`` itself (deferred) for a body with explicit params and no
        hint: its ids are parsed only if the reply needs them (tool calls, no agentkv stats),
        so plain trajectory requests cost a substring search, not a JSON parse."""
        headers = _headers(scope)
        chains = self.state.chains if api == Api.RESPONSES and self.state.responses_chains else None
        if chains is None and not might_carry_hint(raw, headers):
            return _Identified(raw if might_carry_params(raw) else None)
        try:
            body = json.loads(raw)
        except ValueError:
            return _Identified()  # vLLM answers the bad JSON itself
        salt = request_salt(body) if chains is not None else None
        if chains is not None and (refused := foreign_chain(body, chains)) is not None:
            return _Identified(refused=refused)
        identity, problems = resolve_identity(body, headers, chains)
        for p in problems:
            self.state.warn_once(p)
        fatal = [p for p in problems if p.vanilla]
        error = fatal[0].message if fatal else params_error(body)
        conversation = None
        if identity is not None and identity.source == SRC_CHAIN:
            digests = conversation_digests(body, identity.cache_salt)
            if digests is not None:  # a new chain: its input holds its whole history
                st = self.state
                identity = await continued(
                    identity, digests, st.prefixes, st.known, st.counters, st.pause_timeout_s
                )
                conversation = digests[-1]
        if identity is None or not identity.inject:
            return _Identified(identity, None, error, salt=salt)
        self.state.counters[f"identified.{identity.source}"] += 1
        new_raw = inject_identity(raw, body, identity)
        return _Identified(identity, new_raw, error, salt=salt, conversation=conversation)


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
    """Wraps ``send``: spots tool calls in a 200 reply and pauses before its last bytes; records
    a Responses reply's id in the chain table; tells the client why a request was vanilla.

    A JSON reply that may need the error added (a known error, or explicit params not parsed
    yet) is held back until its last chunk (vLLM sends one), then sent with the field added and
    ``content-length`` fixed."""

    def __init__(self, state: HookState, api: Api, found: _Identified, send: Send) -> None:
        self.state = state
        self.api = api
        self.identity = found.identity
        self.error = found.error
        self._send = send
        self._status = 0
        self._sse = False
        self._json = bytearray()
        self._json_overflow = False
        self._held: list[Message] = []
        self._holding = False
        self._scanner = SSEToolScanner(api)
        self._fired = False
        self._body = found.body
        self._salt = found.salt
        self._conversation = found.conversation
        ident = found.identity
        self._named_by = ident.source if isinstance(ident, Identity) and ident.inject else None

    async def send(self, message: Message) -> None:
        try:
            out = await self._observe(message)
        except Exception:
            log.exception("agentkv: auto-pause hook failed; the response is sent as is")
            self._fired = True
            out = [*self._held, message] if self._holding else [message]
            self._holding, self._held = False, []
        for m in out:
            await self._send(m)

    def _resolve(self) -> Identity | None:
        """Parse a deferred identity (once); learns the params' error on the way."""
        if isinstance(self.identity, bytes):
            self.identity, error = resolve_deferred(self.identity)
            self.error = self.error or error
        return self.identity

    async def _observe(self, message: Message) -> list[Message]:
        kind = message.get("type")
        if kind == "http.response.start":
            self._status = int(message.get("status", 0))
            for k, v in message.get("headers") or ():
                if k.lower() == b"content-type" and b"text/event-stream" in v.lower():
                    self._sse = True
            if self._status != 200:
                return [message]
            message = _with_header(message, IDENTIFIED_HEADER, self._named_by)
            if self._sse:
                if isinstance(self.identity, bytes):
                    self._resolve()
                return [_with_error_header(message, self.error)]
            if (
                self.error is not None
                or isinstance(self.identity, bytes)
                or self._named_by is not None
            ):
                self._holding, self._held = True, [message]
                return []
            return [message]
        if kind != "http.response.body" or self._status != 200:
            return [message]
        chunk = bytes(message.get("body", b""))
        last = not message.get("more_body", False)
        if self._sse:
            self._scanner.feed(chunk)
            if not self._fired and (self._scanner.done or last):
                scanner = self._scanner
                await self._fire(scanner.names, scanner.response_id, scanner.output)
            return [message]
        if not self._json_overflow:
            if len(self._json) + len(chunk) > MAX_JSON_RESPONSE:
                self._json_overflow = True
                self._json.clear()
            else:
                self._json += chunk
        if self._holding:
            self._held.append(message)
            if self._json_overflow or self._fired:  # too large to rewrite: send it as it is
                out, self._holding, self._held = self._held, False, []
                return out
            if not last:
                return []
        elif not last or self._fired:
            return [message]
        raw = b"" if self._json_overflow else bytes(self._json)
        names = tool_names_from_json(raw, self.api)
        rid, output = _response_id(raw) if self._records_chain() else (None, None)
        await self._fire(names, rid, output)
        if not self._holding:
            return [message]
        self._holding = False
        start, self._held = self._held[0], []
        stats = b'"agentkv"' in raw
        if self.error is None and not stats:
            self._resolve()  # a trajectory reply carries agentkv stats; none: find out why
        fields: dict[str, str] = {}
        if self.error is not None:
            fields["error"] = self.error
        if self._named_by is not None and stats:
            fields[IDENTIFIED_FIELD] = self._named_by
        if not fields:
            return [start, {"type": "http.response.body", "body": raw, "more_body": False}]
        body = _with_agentkv_fields(raw, fields)
        start = _with_error_header(_with_response_length(start, len(body)), self.error)
        return [start, {"type": "http.response.body", "body": body, "more_body": False}]

    def _records_chain(self) -> bool:
        return self.api == Api.RESPONSES and self.state.responses_chains

    async def _fire(
        self, names: list[str], response_id: str | None, output: list[Any] | None = None
    ) -> None:
        self._fired = True
        if not names and response_id is None:
            return
        ident = self._resolve()
        if response_id is not None and self._records_chain():
            # Every stored response keeps its tenant, a vanilla one (no trajectory) too.
            salt = ident.cache_salt if ident is not None else self._salt
            if ident is not None:
                self.state.chains.record(response_id, ident.trajectory_id, ident.branch, salt)
                if self._conversation is not None and output is not None:
                    whole = extend(self._conversation, output)
                    self.state.prefixes.record(whole, ident.trajectory_id, ident.branch)
            elif salt:
                self.state.chains.record(response_id, None, "", salt)
        if ident is None:
            return
        if not names or not self.state.auto_pause or self.state.pause is None:
            return
        if b'"pause_after"' in self._body and _names_its_pause(self._body):
            # The engine already paused the branch at the request's finish (before these last
            # bytes): a second pause would decide the same wait twice.
            self.state.counters["auto_pause_skipped_pause_after"] += 1
            return
        if self.api not in PAUSE_APIS:
            return
        tools = list(dict.fromkeys(n[:MAX_TOOL_NAME] for n in names))[:MAX_TOOLS]
        self.state.counters["tool_call_responses"] += 1
        try:
            await asyncio.wait_for(
                self.state.pause(
                    ident.trajectory_id,
                    ident.branch,
                    tools,
                    ident.expected_wait_s,
                    ident.lease_cap_s,
                    *((ident.cache_salt,) if ident.cache_salt else ()),
                ),
                timeout=self.state.pause_timeout_s,
            )
            self.state.counters["auto_pauses"] += 1
        except Exception as exc:
            self.state.counters["auto_pause_failed"] += 1
            log.warning(
                "agentkv: auto-pause of %s/%s (tools %s) failed: %r",
                ident.trajectory_id,
                ident.branch,
                ",".join(tools),
                exc,
            )


async def _not_found(send: Send, response_id: str) -> None:
    """vLLM's own answer for a response id its store does not hold: another tenant's response
    is indistinguishable from an unknown one."""
    body = json.dumps(
        {
            "error": {
                "message": f"Response with id '{response_id}' not found.",
                "type": "invalid_request_error",
                "param": "response_id",
                "code": 404,
            }
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 404, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _names_its_pause(raw: bytes) -> bool:
    """Whether the request's agentkv params carry ``pause_after`` (parsed only when the bytes
    contain the name)."""
    try:
        body = json.loads(raw)
        agentkv = body["kv_transfer_params"]["agentkv"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(agentkv, dict) and agentkv.get("pause_after") is not None


def _response_id(raw: bytes) -> tuple[str | None, list[Any] | None]:
    """A Responses reply's id and ``output``."""
    try:
        payload = json.loads(raw)
    except ValueError:
        return None, None
    if not isinstance(payload, dict):
        return None, None
    rid, output = payload.get("id"), payload.get("output")
    return rid if isinstance(rid, str) else None, output if isinstance(output, list) else None


def _with_agentkv_fields(raw: bytes, fields: dict[str, str]) -> bytes:
    """The JSON reply with ``fields`` (``error``, ``identified_by``) set in
    ``kv_transfer_params.agentkv`` (other keys kept)."""
    try:
        payload = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(payload, dict):
        return raw
    ktp = payload.get("kv_transfer_params")
    ktp = dict(ktp) if isinstance(ktp, dict) else {}
    agentkv = ktp.get("agentkv")
    ktp["agentkv"] = {**(agentkv if isinstance(agentkv, dict) else {}), **fields}
    payload["kv_transfer_params"] = ktp
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def _with_error_header(start: Message, error: str | None) -> Message:
    return _with_header(start, ERROR_HEADER, error)


def _with_header(start: Message, name: bytes, text: str | None) -> Message:
    if text is None:
        return start
    value = text.encode("ascii", "replace")[:MAX_ERROR_HEADER].replace(b"\r", b" ")
    new = dict(start)
    new["headers"] = [*list(start.get("headers") or ()), (name, value.replace(b"\n", b" "))]
    return new


def _with_response_length(start: Message, length: int) -> Message:
    new = dict(start)
    headers = [(k, v) for k, v in start.get("headers") or () if k.lower() != b"content-length"]
    new["headers"] = [*headers, (b"content-length", str(length).encode())]
    return new


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
]
