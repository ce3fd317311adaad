"""``vllm.endpoint_plugins`` entry point: the agentkv control routes on vLLM's OpenAI server.

Routes (same host, port and API key as the OpenAI API):
  POST   /agentkv/v1/trajectories/{id}/pause    {tool or tools, expected_wait_s?, branch?} -> decision
  POST   /agentkv/v1/trajectories/{id}/resume   {branch?}                          -> state
  DELETE /agentkv/v1/trajectories/{id}          release everything it holds, in every tier
  GET    /agentkv/v1/trajectories/{id}          state, tier residency, per-turn prefix stats
  GET    /agentkv/v1/status                     pool use, tiers, decisions, prefetch outcomes
Tenants: a trajectory lives in its requests' ``cache_salt`` namespace; every route takes the
caller's tenant from the ``X-AgentKV-Cache-Salt`` header or a ``cache_salt`` body field (GET: the
body or a ``cache_salt`` query parameter), since vllm-router drops unknown headers; two that
differ are a 400. No tenant: the unsalted namespace. Status shows the caller's own tenant's
trajectory ids and aggregate numbers only; the cross-tenant operator view (every tenant's ids,
the learned tool waits, per-tool prefetch outcomes) needs the ``X-AgentKV-Operator-Key`` header
with the ``operator_api_key`` setting's key (``AGENTKV_OPERATOR_KEY``).
Pause, resume and DELETE take an ``Idempotency-Key`` header (or ``idempotency_key`` body field):
a retry with the same key within 600 s answers the first call's answer (header
``Idempotent-Replayed: true``) and applies nothing again; the engine keeps the answers
(``agentkv.idempotency``), so a call whose answer was lost to a timeout (503) is safe to retry.
Metrics: ``agentkv_*`` families on the server's own ``/metrics`` (a collector that reads the
engine's snapshot over the same channel at scrape time; see docs/metrics.md).

``attach_router`` also installs ``agentkv_vllm.hooks.AgentKVHooks`` on the app: trajectory ids
from session hints (``x-session-id``, vllm-router's ``agentic_context``, vLLM's ``session_id``)
and the auto-pause on tool calls of ``/v1/chat/completions``, ``/v1/responses`` (where a
``previous_response_id`` chain is the trajectory when vLLM stores responses) and
``/v1/messages``. It is active only when the connector is enabled;
``auto_pause`` (``kv_connector_extra_config``, default on) switches the pause off. ``GET
/status`` adds the hooks' counters under ``hooks``.

vLLM's auth middleware only guards ``/v1``-style prefixes, so these routes check ``--api-key``
(or ``VLLM_API_KEY``) themselves. They reach the scheduler-side connector over the connector's
local control channel, never through engine internals; after a change they nudge the engine
with a public, cheap engine-client call so queued transfers start even when it is idle.

Trajectory ids and branch names follow ``agentkv.ids``, the grammar the request params use too.
It has no ``/`` precisely so that every id a request accepts is routable: a ``/`` would split
the path segment (Starlette decodes ``%2F`` before routing too), so the route would answer 404
from routing, before any handler runs. An id outside the grammar that does reach a handler (a
space, 257 characters, non-ASCII) gets 422 naming the field, like an invalid body. The handlers
validate ids and bodies themselves because vLLM turns FastAPI's validation errors into 400s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
from argparse import Namespace
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Path, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agentkv.idempotency import KEY_FIELD, KEY_HEADER, MAX_KEY_LEN, validate_key
from agentkv.ids import (
    ID_PATTERN,
    MAX_ID_LEN,
    TENANT_FIELD,
    TENANT_HEADER,
    InvalidIdError,
    validate_id,
)
from agentkv_vllm.control import ControlClient, ControlUnavailable
from agentkv_vllm.control_ops import OPERATOR_FIELD, REPLAYED_FIELD, WAKE_FIELD
from agentkv_vllm.hooks import AgentKVHooks, HookState
from agentkv_vllm.metrics_snapshot import MetricsSnapshot
from agentkv_vllm.params import BranchStr, PauseSpec
from agentkv_vllm.prefetch_issuer import PrefetchIssuer
from agentkv_vllm.pump import timer_pump
from agentkv_vllm.settings import ConnectorSettings

log = logging.getLogger("agentkv.routes")


class RoutingHints(BaseModel):
    """Fields a router reads to send a control call where the trajectory's turns go; the server
    ignores them. vllm-router drops client headers on routes it does not know, so the session
    travels in the body: ``agent_hint.session_id`` (or ``vllm_xargs.agentic_context``)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(
        default=None,
        max_length=512,
        description="The served model, as in the OpenAI body (routers scope sessions by it).",
    )
    agent_hint: dict[str, Any] | None = Field(
        default=None, description='Router session hint, e.g. {"session_id": "<trajectory id>"}.'
    )
    vllm_xargs: dict[str, Any] | None = Field(
        default=None, description="vLLM-style extra args carrying agentic_context (routers)."
    )


ROUTING_FIELDS = {"model", "agent_hint", "vllm_xargs"}
MAX_SALT_LEN = 4096


class ControlBody(RoutingHints):
    """A control call's body: the routing hints and the caller's tenant."""

    cache_salt: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_SALT_LEN,
        description="The trajectory's tenant: the cache_salt its requests carry (as the "
        "X-AgentKV-Cache-Salt header, which routers drop). Absent: the unsalted namespace.",
    )


class Keyed(ControlBody):
    """A control call that changes state: ``idempotency_key`` (or the ``Idempotency-Key``
    header) makes a retry answer the first call's answer instead of applying it again."""

    idempotency_key: str | None = Field(
        default=None,
        description="Retry key (as the Idempotency-Key header; routers drop unknown headers): "
        "a retry with the same key within 600 s answers the first call's answer, applied once. "
        f"1-{MAX_KEY_LEN} visible ASCII characters.",
    )

    @field_validator("idempotency_key")
    @classmethod
    def _key_grammar(cls, value: str | None) -> str | None:
        return None if value is None else validate_key(value)


class PauseBody(Keyed, PauseSpec):
    model_config = ConfigDict(extra="forbid")
    branch: BranchStr = "main"


class ResumeBody(Keyed):
    model_config = ConfigDict(extra="forbid")
    branch: BranchStr = "main"


class EndBody(Keyed):
    model_config = ConfigDict(extra="forbid")


class _State:
    client: ControlClient | None = None  # DP rank 0: status, metrics
    clients: list[ControlClient] = []  # noqa: RUF012 - one per DP rank
    api_keys: list[str] = []  # noqa: RUF012 - process-wide route state
    operator_key: str | None = None  # the status route's operator view (none: no such view)
    engine_client: Any = None
    pump: asyncio.Task[None] | None = None
    hooks: HookState = HookState()
    hooks_clients: list[ControlClient] = []  # noqa: RUF012 - auto-pause, one per DP rank
    background: set[asyncio.Task[Any]] = set()  # noqa: RUF012 - strong refs to nudge tasks
    issuers: list[PrefetchIssuer] = []  # noqa: RUF012 - device prefetch, one per DP rank


def _extra_config(args: Namespace) -> dict[str, Any]:
    raw = getattr(args, "kv_transfer_config", None)
    extra: dict[str, Any] = {}
    if raw is not None:
        cfg = json.loads(raw) if isinstance(raw, str) else raw
        extra = dict(
            (
                cfg.get("kv_connector_extra_config")
                if isinstance(cfg, dict)
                else getattr(cfg, "kv_connector_extra_config", None)
            )
            or {}
        )
    return extra


def _engine_id(args: Namespace) -> str | None:
    """vLLM's ``kv_transfer_config.engine_id`` of this server (set when the config is parsed,
    before the engine cores start, so they share it)."""
    raw = getattr(args, "kv_transfer_config", None)
    cfg = json.loads(raw) if isinstance(raw, str) else raw
    value = cfg.get("engine_id") if isinstance(cfg, dict) else getattr(cfg, "engine_id", None)
    return str(value) if value else None


def _auto_pause_setting(settings: ConnectorSettings, extra: dict[str, Any]) -> bool:
    """``auto_pause`` from the connector settings (default on)."""
    return bool(settings.auto_pause)


def _responses_store_enabled() -> bool:
    """vLLM stores Responses (so ``previous_response_id`` chains exist) only with
    ``VLLM_ENABLE_RESPONSES_API_STORE=1`` (read the way vllm.envs reads it)."""
    try:
        return bool(int(os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "0")))
    except ValueError:
        return False


async def _check_api_key(request: Request) -> None:
    # async: FastAPI runs a sync dependency in a worker thread, a thread hop on every call.
    keys = _State.api_keys
    if not keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not any(secrets.compare_digest(token, k) for k in keys):
        raise HTTPException(status_code=401, detail="missing or wrong API key")


router = APIRouter(prefix="/agentkv/v1", tags=["agentkv"], dependencies=[Depends(_check_api_key)])
# No ``pattern=`` here: FastAPI's own check would fail as a RequestValidationError, which vLLM
# answers with 400; the handlers call _check_id instead (422). The schema still shows the grammar.
TrajectoryId = Path(
    description="Trajectory id, as sent in kv_transfer_params.agentkv.trajectory_id "
    "(the grammar of agentkv.ids)",
    json_schema_extra={"pattern": ID_PATTERN, "minLength": 1, "maxLength": MAX_ID_LEN},
)


# The trajectory's tenant on the control routes: the cache_salt its requests carry. Without it a
# route addresses the unsalted namespace; another tenant's trajectory of the same id is a 404.
OPERATOR_HEADER = "X-AgentKV-Operator-Key"


def _tenant(request: Request, body: ControlBody) -> dict[str, str] | JSONResponse:
    """The caller's tenant as control fields (header, body field or query parameter; those
    present must agree, else 400), or the error."""
    named = {
        where: value
        for where, value in (
            (f"header {TENANT_HEADER}", request.headers.get(TENANT_HEADER)),
            (f"body {TENANT_FIELD}", body.cache_salt),
            (f"query {TENANT_FIELD}", request.query_params.get(TENANT_FIELD)),
        )
        if value
    }
    if len(set(named.values())) > 1:
        return JSONResponse(
            status_code=400,
            content={"detail": f"the tenant differs between {' and '.join(named)}"},
        )
    salt = next(iter(named.values()), None)
    return {TENANT_FIELD: salt} if salt else {}


def _operator(request: Request) -> bool | JSONResponse:
    """Whether the caller asks for the operator view with the right key (403 when the key is
    wrong or the server has none)."""
    given = request.headers.get(OPERATOR_HEADER)
    if given is None:
        return False
    key = _State.operator_key
    if not key or not secrets.compare_digest(given.encode(), key.encode()):
        return JSONResponse(status_code=403, content={"detail": "wrong operator key"})
    return True


REPLAYED_HEADER = "Idempotent-Replayed"


def _idempotency(request: Request, body: Keyed) -> dict[str, str] | JSONResponse:
    """The call's idempotency key (header or body field; both must agree), as control fields,
    or the 422 naming the problem."""
    header = request.headers.get(KEY_HEADER)
    if header is not None:
        try:
            validate_key(header)
        except ValueError as exc:
            return _invalid(
                [{"loc": ["header", KEY_HEADER], "msg": str(exc), "type": "value_error"}]
            )
        if body.idempotency_key is not None and body.idempotency_key != header:
            msg = f"the {KEY_HEADER} header and the body's {KEY_FIELD} differ"
            return _invalid([{"loc": [KEY_FIELD], "msg": msg, "type": "value_error"}])
    key = header if header is not None else body.idempotency_key
    return {KEY_FIELD: key} if key is not None else {}


async def _call(op: str, nudge: bool = False, **fields: Any) -> JSONResponse:
    if _State.client is None:
        raise HTTPException(
            status_code=503,
            detail="agentkv connector is not enabled on this server (--kv-transfer-config)",
        )
    try:
        if "trajectory_id" in fields and len(_State.clients) > 1:
            status, body = await _fan_out(_State.clients, op, **fields)
        else:
            status, body = await _State.client.call(op, **fields)
    except ControlUnavailable as exc:
        detail = str(exc)
        if KEY_FIELD in fields:
            detail += f"; it may have been applied: retry with the same {KEY_HEADER}"
        raise HTTPException(status_code=503, detail=detail) from None
    replayed = bool(body.pop(REPLAYED_FIELD, False))
    # An engine that does not say (an older one) is woken as before.
    if nudge and status < 400 and body.pop(WAKE_FIELD, True):
        _nudge_soon()
    body.pop(WAKE_FIELD, None)
    headers = {REPLAYED_HEADER: "true"} if replayed else None
    return JSONResponse(status_code=status, content=body, headers=headers)


async def _fan_out(clients: list[Any], op: str, **fields: Any) -> tuple[int, dict[str, Any]]:
    """A trajectory op on every DP rank: each engine core holds its own trajectories, and the
    same id may hold state on several (a request of it routed to each). Every rank that knows
    it applies the op; 404 only when none does. DELETE's counts are summed over the ranks;
    pause, resume and GET answer with the first rank's body that knows it. ``dp_ranks``: the
    ranks that know it."""
    answers = [await client.call(op, **fields) for client in clients]
    known = [(rank, s, b) for rank, (s, b) in enumerate(answers) if s != 404]
    if not known:
        return answers[0]
    _, status, body = known[0]
    body = dict(body)
    if op == "end":
        for field in ("released_blocks", "dropped_tier_blocks"):
            body[field] = sum(int(b.get(field, 0)) for _, s, b in known if s == 200)
        status = 200 if any(s == 200 for _, s, _ in known) else status
    body["dp_ranks"] = [rank for rank, _, _ in known]
    # A wake-up is one utility call, whichever rank needs it.
    body[WAKE_FIELD] = any(b.get(WAKE_FIELD, True) for _, b in answers)
    return status, body


M = TypeVar("M", bound=BaseModel)


def _invalid(errors: list[dict[str, Any]]) -> JSONResponse:
    """422 ``{"detail": "invalid <where>: <msg>", "errors": [{loc, msg, type}, ...]}``."""
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"]) or "body"
    return JSONResponse(
        status_code=422,
        content={"detail": f"invalid {where}: {first['msg']}", "errors": errors},
    )


def _check_id(trajectory_id: str) -> JSONResponse | None:
    """None when the path's trajectory id is in the id grammar, else the 422 naming it."""
    try:
        validate_id(trajectory_id, "trajectory_id")
    except InvalidIdError as exc:
        return _invalid([{"loc": ["path", "trajectory_id"], "msg": str(exc), "type": "invalid_id"}])
    return None


async def _parse(request: Request, model: type[M], optional: bool = False) -> M | JSONResponse:
    """Validate the JSON body ourselves: vLLM turns FastAPI's validation errors into 400s, and
    this API promises 422 with the failing field named."""
    raw = await request.body()
    if not raw.strip() and optional:
        return model()
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        return _invalid(
            [
                {"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")}
                for e in exc.errors()
            ]
        )


C = TypeVar("C", bound=ControlBody)


async def _body_and_tenant(
    request: Request, model: type[C], optional: bool = False
) -> tuple[C, dict[str, str]] | JSONResponse:
    """The validated body and the caller's tenant as control fields, or the 422/400."""
    body = await _parse(request, model, optional=optional)
    if isinstance(body, JSONResponse):
        return body
    tenant = _tenant(request, body)
    if isinstance(tenant, JSONResponse):
        return tenant
    return body, tenant


K = TypeVar("K", bound=Keyed)


async def _keyed_op(
    op: str, request: Request, trajectory_id: str, model: type[K], optional: bool = False
) -> JSONResponse:
    """pause, resume and end: check the path's id, the body and the idempotency key (the 422
    names the first problem), then run ``op`` with the body's control fields (routing hints
    and the key field left out), the tenant and the key, and nudge the engine."""
    if bad := _check_id(trajectory_id):
        return bad
    parsed = await _body_and_tenant(request, model, optional=optional)
    if isinstance(parsed, JSONResponse):
        return parsed
    body, tenant = parsed
    key = _idempotency(request, body)
    if isinstance(key, JSONResponse):
        return key
    return await _call(
        op,
        nudge=True,
        trajectory_id=trajectory_id,
        **body.model_dump(exclude=ROUTING_FIELDS | {KEY_FIELD, TENANT_FIELD}),
        **tenant,
        **key,
    )


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


@router.post(
    "/trajectories/{trajectory_id}/pause",
    summary="Pause a trajectory for a tool wait",
    openapi_extra=_body_schema(PauseBody),
)
async def pause(request: Request, trajectory_id: str = TrajectoryId) -> JSONResponse:
    return await _keyed_op("pause", request, trajectory_id, PauseBody)


@router.post(
    "/trajectories/{trajectory_id}/resume",
    summary="Tell the engine a trajectory's tool returned",
    openapi_extra=_body_schema(ResumeBody),
)
async def resume(request: Request, trajectory_id: str = TrajectoryId) -> JSONResponse:
    return await _keyed_op("resume", request, trajectory_id, ResumeBody, optional=True)


@router.delete("/trajectories/{trajectory_id}", summary="End a trajectory and release all it holds")
async def end(request: Request, trajectory_id: str = TrajectoryId) -> JSONResponse:
    # An optional body ``{"model": ...}`` only serves a router; it is validated all the same.
    return await _keyed_op("end", request, trajectory_id, EndBody, optional=True)


@router.get(
    "/trajectories/{trajectory_id}",
    summary="State, tier residency and prefix stats of a trajectory",
)
async def get(request: Request, trajectory_id: str = TrajectoryId) -> JSONResponse:
    # An optional body (routing hints, cache_salt) as the SDK sends; or ?cache_salt=.
    if bad := _check_id(trajectory_id):
        return bad
    parsed = await _body_and_tenant(request, ControlBody, optional=True)
    if isinstance(parsed, JSONResponse):
        return parsed
    return await _call("get", nudge=True, trajectory_id=trajectory_id, **parsed[1])


@router.get("/status", summary="Pool use, tiers, decisions and prefetch outcomes")
async def status(request: Request) -> JSONResponse:
    # The caller's tenant's view; the operator's (every tenant) with X-AgentKV-Operator-Key.
    parsed = await _body_and_tenant(request, ControlBody, optional=True)
    if isinstance(parsed, JSONResponse):
        return parsed
    tenant = parsed[1]
    operator = _operator(request)
    if isinstance(operator, JSONResponse):
        return operator
    response = await _call("status", nudge=True, **{OPERATOR_FIELD: operator}, **tenant)
    if response.status_code == 200:
        body = json.loads(bytes(response.body))
        body["hooks"] = _State.hooks.view()
        return JSONResponse(status_code=200, content=body)
    return response


async def _auto_pause(
    trajectory_id: str,
    branch: str,
    tools: list[str],
    expected_wait_s: float | None,
    lease_cap_s: float | None = None,
    cache_salt: str | None = None,
) -> None:
    """The hooks' pause: the same control op as the pause route, then a background nudge so
    the engine starts the decision's transfers even when it is idle. Raises on failure (the
    hook counts and logs it; the response goes out regardless)."""
    clients = _State.hooks_clients
    if not clients:
        raise ControlUnavailable("agentkv connector is not enabled on this server")
    status, body = await _fan_out(
        clients,
        "pause",
        trajectory_id=trajectory_id,
        branch=branch,
        tool=tools[0],
        tools=tools,
        expected_wait_s=expected_wait_s,
        max_lease_s=lease_cap_s,
        **({"cache_salt": cache_salt} if cache_salt else {}),
    )
    if status >= 400:
        raise RuntimeError(f"pause answered {status}: {body.get('detail')}")
    log.debug(
        "agentkv: auto-pause %s/%s tools=%s -> %s",
        trajectory_id,
        branch,
        ",".join(tools),
        (body.get("decision") or {}).get("action"),
    )
    if body.get(WAKE_FIELD, True):
        _nudge_soon()


async def _known(trajectory_id: str, cache_salt: str | None = None) -> bool:
    """The hooks' check before a resent Responses conversation continues a trajectory: does an
    engine still hold it (not DELETEd, not expired)? Raises when none answers."""
    if not _State.hooks_clients:
        raise ControlUnavailable("agentkv connector is not enabled on this server")
    salt = {"cache_salt": cache_salt} if cache_salt else {}
    status, _ = await _fan_out(_State.hooks_clients, "known", trajectory_id=trajectory_id, **salt)
    return status != 404


def _nudge_soon() -> None:
    """Wake an idle engine loop (any utility call does; it then runs the transfers the op
    queued) without waiting for it: the utility call is answered between engine steps, so
    awaiting it would add up to a whole step to every pause and resume the agent waits on."""
    if _State.engine_client is None:
        return
    task = asyncio.get_running_loop().create_task(_nudge())
    _State.background.add(task)
    task.add_done_callback(_State.background.discard)


async def _nudge() -> None:
    try:
        await _State.engine_client.is_sleeping()
    except Exception as exc:
        log.debug("agentkv: engine nudge failed: %s", exc)


class AgentKVRoutes:
    name = "agentkv_routes"
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)
        # Innermost of the app's middleware (vLLM adds its auth middleware after this), so
        # unauthenticated requests never reach it. Inactive until init_state enables it.
        app.add_middleware(AgentKVHooks, state=_State.hooks)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        keys = list(getattr(args, "api_key", None) or [])
        if isinstance(getattr(args, "api_key", None), str):
            keys = [args.api_key]
        if env_key := os.environ.get("VLLM_API_KEY"):
            keys.append(env_key)
        _State.api_keys = keys
        _State.operator_key = None
        _State.engine_client = engine_client
        _State.hooks.enabled = False
        if getattr(args, "kv_transfer_config", None) is None:
            _State.client = None
            return
        try:
            extra = _extra_config(args)
            settings = ConnectorSettings.model_validate(extra)
        except Exception as exc:
            log.warning("agentkv routes: cannot read kv_connector_extra_config (%s)", exc)
            return
        _State.operator_key = settings.operator_key()
        engine_id = _engine_id(args)
        dp_size = max(1, int(getattr(args, "data_parallel_size", 1) or 1))
        _State.clients = [
            ControlClient(settings.control_endpoint(engine_id, rank)) for rank in range(dp_size)
        ]
        _State.client = _State.clients[0]
        # A short timeout: the auto-pause holds a response's last bytes while it runs.
        # Every DP rank: the trajectory may hold state on any of them.
        _State.hooks_clients = [
            ControlClient(settings.control_endpoint(engine_id, rank), timeout_s=2.0)
            for rank in range(dp_size)
        ]
        _State.hooks.auto_pause = _auto_pause_setting(settings, extra)
        _State.hooks.pause = _auto_pause
        _State.hooks.known = _known
        _State.hooks.responses_chains = _responses_store_enabled()
        _State.hooks.enabled = True
        _register_metrics(_State.client)
        if _State.pump is None:
            loop = asyncio.get_running_loop()
            # Each DP rank's manager orders prefetches for its own trajectories: its pump
            # issues them to that rank.
            _State.issuers = [
                PrefetchIssuer(engine_client, rank if dp_size > 1 else None)
                for rank in range(dp_size)
            ]
            _State.pump = loop.create_task(
                timer_pump(_State.client, _State.issuers[0], engine_client)
            )
            for client, issuer in zip(_State.clients[1:], _State.issuers[1:], strict=True):
                _State.background.add(loop.create_task(timer_pump(client, issuer, engine_client)))


METRICS_TIMEOUT_S = 1.0
_metrics_registered = False


def _register_metrics(client: ControlClient) -> None:
    """Serve agentkv's metrics on vLLM's /metrics (vLLM serves prometheus_client's REGISTRY)."""
    global _metrics_registered
    if _metrics_registered:
        return
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # vLLM then serves only the files of prometheus_client's multiprocess mode, which a
        # pull-time collector cannot write to; OTLP export still works.
        log.warning(
            "agentkv: agentkv_* metrics are not on /metrics with several API server processes "
            "(PROMETHEUS_MULTIPROC_DIR); use the OTLP export (OTEL_* variables)"
        )
        return
    from prometheus_client import REGISTRY

    from agentkv.prometheus_export import SnapshotCollector

    snapshot = MetricsSnapshot(client, timeout_s=METRICS_TIMEOUT_S)
    _State.hooks.before_metrics = snapshot.refresh
    REGISTRY.register(SnapshotCollector(snapshot.fetch))
    _metrics_registered = True


def _keep_warnings_visible() -> None:
    """vLLM's API server imports model_hosting_container_standards, which sets the *root*
    logger to ERROR; every ``agentkv.*`` logger without a level of its own would then drop its
    warnings (a malformed session hint, a failed auto-pause) in this process."""
    pkg = logging.getLogger("agentkv")
    if pkg.level == logging.NOTSET:
        pkg.setLevel(logging.WARNING)


def register_routes() -> AgentKVRoutes:
    _keep_warnings_visible()
    return AgentKVRoutes()
