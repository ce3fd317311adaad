"""A request's trajectory, from the explicit params, a session hint or a Responses chain. Pure.

Primitives:
  Problem              one malformed hint (what warn-once dedupes on)
  Identity             a request's trajectory, where it came from, declared wait and lease cap,
                       and what the body rewrite adds (``kv_transfer_params``, ``request_id``)
  resolve_identity(body, headers, chains) -> (Identity | None, [Problem])
  params_error(body) -> str | None          why explicit ``kv_transfer_params.agentkv`` is
                                            malformed (the engine's log text), else None
  resolve_deferred(raw) -> (Identity | None, error | None)   the same from raw bytes
  might_carry_hint(raw, headers) / might_carry_params(raw)   cheap byte tests: False proves
                                            there is nothing to parse
  inject_identity(raw, body, identity) -> bytes            the rewritten body
  request_salt(body) -> str | None          the body's ``cache_salt`` (its tenant), if any
  foreign_chain(body, chains) -> str | None the ``previous_response_id`` when it names another
                                            tenant's salted response (the hooks answer 404)

Sources, in precedence order (the first present decides; a malformed one makes the request
vanilla, a lower one is not tried instead):
  1. ``kv_transfer_params.agentkv`` (the explicit contract; left untouched)
  2. the body's ``session_id`` (vLLM 0.32's own session field)
  3. the ``x-session-id`` header
  4. ``vllm_xargs.agentic_context`` (vllm-router: a JSON string) ``.session_id``
  5. ``vllm_xargs.session_id``
  6. the body's ``prompt_cache_key`` (OpenAI's field on chat, completions and Responses; the
     Agents SDK, LangChain and pydantic-ai forward it as a first-class parameter)
  7. ``/v1/responses`` only, when the server stores responses: the chain. A request with
     ``previous_response_id`` continues the trajectory of that response (recorded when it was
     served; an id the table does not know names the trajectory itself); one without starts a
     chain whose trajectory id is its own response id (``request_id``, which vLLM uses as the
     response id; generated and added to the body when absent). ``store: false`` opts out.
     At the same level, ``responses_prefix``: a request that would start a chain but whose
     ``input`` resends a stored response's whole conversation (the Agents SDK's default: no
     ``previous_response_id``, the full history each turn) continues that response's
     trajectory instead (``agentkv_vllm.prefixes``; the hooks decide it, since it needs the
     engine's word that the trajectory still exists).

Why ``prompt_cache_key`` is 6: it is a *cache-routing* key, not a session id. OpenAI buckets
requests by it for prefix-cache hits, and its guide suggests sharing one key across the requests
that share a prefix (per user, per system prompt), so one key may span several concurrent
conversations. Every source that names a session by intent (1-5) is therefore more specific and
wins; a client that sends both a ``session_id``/``x-session-id`` and a shared cache key gets one
trajectory per session. It still outranks the chain and the resent conversation: it is what the
client said, where those are inferred. With a chain and a key both present they agree when the
chain's first request carried the same key (its trajectory is the key).

``prompt_cache_retention`` (OpenAI: ``"in_memory"`` or ``"24h"``, a *maximum* retention) caps the
lease of the trajectory's auto-pause like ``agentic_context.kv_retention_ttl_seconds`` does (the
smaller cap wins when both are given), whichever source named the trajectory; an unknown value is
ignored with a warning (the request keeps its trajectory).

The byte tests decide on *parsed* keys, never on patterns in the raw text: a body whose bytes
hold a JSON escape (``\\u``) may spell a key in escapes (``"session\\u005fid"``), so it is
parsed like any body that may carry a hint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentkv.ids import MAX_ID_LEN, TENANT_FIELD, is_valid_id
from agentkv_vllm.chains import ResponseChains
from agentkv_vllm.params import parse_request_params

DEFAULT_BRANCH = "main"
# Sources, in precedence order (the names used in warnings, counters and docs).
SRC_PARAMS = "kv_transfer_params"
SRC_BODY = "session_id"
SRC_HEADER = "x-session-id"
SRC_CONTEXT = "agentic_context"
SRC_XARGS = "vllm_xargs.session_id"
SRC_CACHE_KEY = "prompt_cache_key"
SRC_CHAIN = "responses_chain"
# Same level as the chain: a new chain whose input resends a stored response's conversation
# continues that response's trajectory (``agentkv_vllm.prefixes``; decided by the hooks).
SRC_PREFIX = "responses_prefix"
SOURCES = (
    SRC_PARAMS,
    SRC_BODY,
    SRC_HEADER,
    SRC_CONTEXT,
    SRC_XARGS,
    SRC_CACHE_KEY,
    SRC_CHAIN,
    SRC_PREFIX,
)
RETENTION_FIELD = "prompt_cache_retention"
# OpenAI's retention values -> the longest lease (seconds) a pause may keep the context for.
# "in_memory": OpenAI keeps such prefixes 5-10 minutes idle, at most an hour; "24h": a day.
RETENTION_CAPS_S: Mapping[str, float] = {"in_memory": 3600.0, "in-memory": 3600.0, "24h": 86400.0}
# Bytes whose absence from a body proves it carries no hint / no explicit params (no JSON parse).
# A JSON escape can spell any key, so its presence means "parse". The retention field names no
# trajectory but is parsed (and warned about) eagerly too.
_HINT_MARKERS = (
    b'"session_id"',
    b'"agentic_context"',
    b'"prompt_cache_key"',
    b'"prompt_cache_retention"',
    b"\\u",
)
_PARAMS_MARKERS = (b'"agentkv"', b"\\u")


@dataclass(frozen=True)
class Problem:
    """One malformed hint: ``key`` (source, kind) is what warn-once dedupes on."""

    source: str
    kind: str
    message: str
    vanilla: bool = True
    """False: only this value is ignored (a bad wait or retention); the request keeps its
    trajectory."""

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
    request_id: str | None = None
    """A ``request_id`` to add to the body (a new Responses chain named after its response)."""
    cache_salt: str | None = None
    """The body's ``cache_salt``: the tenant whose namespace holds the trajectory."""


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
                vanilla=False,
            )
        )
    return value


def _retention_cap(body: Mapping[str, Any], problems: list[Problem]) -> float | None:
    """``prompt_cache_retention`` as a lease cap in seconds (None: absent or unknown)."""
    value = body.get(RETENTION_FIELD)
    if value is None:
        return None
    cap = RETENTION_CAPS_S.get(value) if isinstance(value, str) else None
    if cap is None:
        problems.append(
            Problem(
                RETENTION_FIELD,
                "value",
                f"{RETENTION_FIELD} {_shown(value)} is not one of "
                f"{', '.join(repr(k) for k in RETENTION_CAPS_S)}; ignored",
                vanilla=False,
            )
        )
    return cap


def _min_cap(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def resolve_identity(
    body: Any, headers: Mapping[str, str], chains: ResponseChains | None = None
) -> tuple[Identity | None, list[Problem]]:
    """The trajectory a request belongs to (in its ``cache_salt``'s namespace), and the
    malformed hints met on the way. Pure."""
    ident, problems = _resolve_identity(body, headers, chains)
    salt = request_salt(body)
    if ident is not None and salt:
        ident = dataclasses.replace(ident, cache_salt=salt)
    return ident, problems


def request_salt(body: Any) -> str | None:
    """The body's ``cache_salt`` (the tenant whose namespace its KV and trajectory are in)."""
    salt = body.get(TENANT_FIELD) if isinstance(body, dict) else None
    return salt if isinstance(salt, str) and salt else None


def foreign_chain(body: Any, chains: ResponseChains) -> str | None:
    """The body's ``previous_response_id`` when another tenant's salted request produced it:
    vLLM would render that conversation into this request's prompt, so it is refused whatever
    names the trajectory (params, hint or chain)."""
    prev = body.get("previous_response_id") if isinstance(body, dict) else None
    if isinstance(prev, str) and chains.foreign(prev, request_salt(body)):
        return prev
    return None


def _resolve_identity(
    body: Any, headers: Mapping[str, str], chains: ResponseChains | None = None
) -> tuple[Identity | None, list[Problem]]:
    """``resolve_identity`` before the tenant.

    ``headers``: lower-case names. ``chains``: the Responses chain table, for a ``/v1/responses``
    request on a server that stores responses (source 6); None elsewhere. Explicit params are
    not validated into a Problem here (the engine warns; ``params_error`` says why): a malformed
    ``kv_transfer_params.agentkv`` is a vanilla request.
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
    ttl = _min_cap(
        _context_seconds(ctx, "kv_retention_ttl_seconds", problems),
        _retention_cap(body, problems),
    )
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
    if body.get(SRC_CACHE_KEY) is not None:
        candidates.append((SRC_CACHE_KEY, body[SRC_CACHE_KEY]))
    if not candidates:
        if chains is not None:
            return _chain_identity(body, chains, wait, ttl), problems
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
    return any(m in raw for m in _PARAMS_MARKERS)


def params_error(body: Any) -> str | None:
    """Why the body's ``kv_transfer_params.agentkv`` is malformed (the text the engine logs when
    it serves the request as vanilla), or None when it is absent or valid."""
    if not isinstance(body, dict):
        return None
    ktp = body.get("kv_transfer_params")
    if not isinstance(ktp, dict) or ktp.get("agentkv") is None:
        return None
    return parse_request_params(ktp).warning


def resolve_deferred(raw: bytes) -> tuple[Identity | None, str | None]:
    """The identity of a body with explicit params and no hint, or why its params are malformed;
    parsed only when needed."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None, None
    return resolve_identity(body, {})[0], params_error(body)


def _chain_identity(
    body: dict[str, Any], chains: ResponseChains, wait: float | None, ttl: float | None
) -> Identity | None:
    """Source 7 (see the module docstring)."""
    if body.get("store") is False:
        return None
    prev = body.get("previous_response_id")
    if prev is not None:
        if isinstance(prev, str) and chains.foreign(prev, request_salt(body)):
            return None  # another tenant's chain is never continued (the hooks refuse it)
        found = chains.lookup(prev) if isinstance(prev, str) else None
        if found is not None:
            return Identity(found[0], found[1], SRC_CHAIN, True, wait, ttl)
        if is_valid_id(prev):
            return Identity(str(prev), DEFAULT_BRANCH, SRC_CHAIN, True, wait, ttl)
        return None
    rid = body.get("request_id")
    if rid is None:
        new = f"resp_{uuid.uuid4().hex}"
        return Identity(new, DEFAULT_BRANCH, SRC_CHAIN, True, wait, ttl, request_id=new)
    if is_valid_id(rid):
        return Identity(str(rid), DEFAULT_BRANCH, SRC_CHAIN, True, wait, ttl)
    return None


def inject_identity(raw: bytes, body: dict[str, Any], identity: Identity) -> bytes:
    """``raw`` with ``kv_transfer_params.agentkv = {trajectory_id, branch}`` added.

    Without ``kv_transfer_params`` in the body the member is spliced in before the closing brace
    (the rest of the bytes stay as sent); with one (another connector's keys) the body is
    re-serialized with the keys merged.
    """
    agentkv = {"trajectory_id": identity.trajectory_id, "branch": identity.branch}
    if body.get("kv_transfer_params") is None and "kv_transfer_params" not in body:
        members = {"kv_transfer_params": {"agentkv": agentkv}}
        if identity.request_id is not None:
            members["request_id"] = identity.request_id  # type: ignore[assignment]
        stripped = raw.rstrip()
        if stripped.endswith(b"}"):
            inner = json.dumps(members, separators=(",", ":")).encode()[1:-1]
            head = stripped[:-1].rstrip()
            sep = b"" if head.endswith(b"{") else b","
            return head + sep + inner + b"}"
    merged = dict(body)
    merged["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}), "agentkv": agentkv}
    if identity.request_id is not None:
        merged["request_id"] = identity.request_id
    return json.dumps(merged, separators=(",", ":"), ensure_ascii=False).encode()
