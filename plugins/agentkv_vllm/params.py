"""The per-request contract: ``kv_transfer_params = {"agentkv": {...}}``.

Primitives:
  AgentKVParams      validated params (trajectory_id, branch, zones, pause_after, and the
                     implicit pause's implicit_pause and env)
  IMPLICIT_PAUSE_ENV the implicit pause's tool name when a request names no ``env``
  PauseSpec          a pause's fields (tool or tools, expected_wait_s, max_lease_s): the pause
                     route's body and a request's ``pause_after``
  TrajectoryIdStr, BranchStr   pydantic string types in the id grammar of ``agentkv.ids``
  parse_request_params(raw) -> ParseResult: params or None plus a warning; never raises
  IdentitySource     where the engine found a request's trajectory (ENGINE_PRECEDENCE order)
  AgentHint          uni-agent's ``kv_transfer_params.agent_hint`` (trajectory id, lease_until)
  KV_HINT_ACTION     the ``kv_hints`` action type agentkv reads (payload: an AgentKVParams body)
  resolve_request_identity(kv_transfer_params, session_id, kv_hints) -> EngineIdentity
                     the engine-side precedence over everything a vLLM ``Request`` carries;
                     never raises

Malformed params never fail a request: the request is served like vanilla vLLM and one warning
is logged, because a bad client field must not cost the user their answer. Trajectory ids and
branch names follow ``agentkv.ids`` (no ``/``, so every accepted id is usable in the routes).

Engine-side sources (docs/hints.md "Engine-side identity"), the first present decides and a
malformed one makes the request vanilla (a lower one is not tried instead, as in the API
middleware's list):
  1. ``kv_transfer_params.agentkv``   the explicit contract (what the middleware injects too)
  2. ``Request.session_id``           vLLM's own: body ``session_id``, ``X-Session-ID``,
                                      ``vllm_xargs.session_id``, ``/inference/v1/generate``'s
                                      header, ``AsyncLLM.generate(session_id=)``
  3. ``Request.kv_hints``             the first action of type KV_HINT_ACTION
  4. ``kv_transfer_params.agent_hint`` uni-agent; its ``lease_until`` caps the leases of the
                                      trajectory's pauses
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from agentkv.ids import ID_PATTERN, MAX_ID_LEN, InvalidIdError, validate_id


def _id_check(what: str) -> Callable[[str], str]:
    def check(value: str) -> str:
        try:
            return validate_id(value, what)
        except InvalidIdError as exc:
            raise PydanticCustomError("invalid_id", "{reason}", {"reason": str(exc)}) from None

    return check


_ID_SCHEMA = {"pattern": ID_PATTERN, "minLength": 1, "maxLength": MAX_ID_LEN}
TrajectoryIdStr = Annotated[
    str, AfterValidator(_id_check("trajectory_id")), Field(json_schema_extra=_ID_SCHEMA)
]
BranchStr = Annotated[str, AfterValidator(_id_check("branch")), Field(json_schema_extra=_ID_SCHEMA)]


class Zone(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(max_length=64)
    start_token: int | None = Field(default=None, ge=0)
    end_token: int | None = Field(default=None, ge=0)
    start_message: int | None = Field(default=None, ge=0)
    end_message: int | None = Field(default=None, ge=0)


ToolName = Annotated[str, Field(min_length=1, max_length=128)]
MAX_WAIT_S = 30 * 86400
# The tool name implicit pauses are learned under when a request names no ``env``: one key for
# every trajectory (a rollout's environment steps share a distribution; a per-trajectory key
# would learn from a handful of samples).
IMPLICIT_PAUSE_ENV = "env"


class PauseSpec(BaseModel):
    """What a pause says: the pause route's body (``routes.PauseBody``) and a request's
    ``pause_after``, one definition."""

    model_config = ConfigDict(extra="forbid")
    tool: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="Tool name; waits are learned per tool. Required unless `tools` is given.",
    )
    tools: list[ToolName] | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description="Parallel tool calls: the pause is predicted (and learned) as the tool with "
        "the longest predicted wait.",
    )
    expected_wait_s: float | None = Field(
        default=None,
        ge=0,
        le=MAX_WAIT_S,
        allow_inf_nan=False,
        description="The harness's own estimate of the wait.",
    )
    max_lease_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_WAIT_S,
        allow_inf_nan=False,
        description="Cap on a retain decision's lease (e.g. the client's KV retention TTL).",
    )

    @model_validator(mode="after")
    def _one_tool_at_least(self) -> PauseSpec:
        if self.tool is None and not self.tools:
            raise ValueError("give `tool` or `tools`")
        return self

    @property
    def tool_names(self) -> list[str]:
        return list(self.tools) if self.tools else [str(self.tool)]


class AgentKVParams(BaseModel):
    model_config = ConfigDict(extra="ignore")
    trajectory_id: TrajectoryIdStr
    branch: BranchStr = "main"
    zones: list[Zone] = Field(default_factory=list, max_length=32)
    tool: str | None = Field(default=None, max_length=128)
    # Set only by the plugin's own device-prefetch requests (a random ticket the manager
    # issued); an unknown ticket is served as a vanilla request.
    prefetch: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$")
    # The pause that follows this request (the agent knows its next step is a tool): the engine
    # pauses the branch when the request finishes, and the branch's next request resumes it, so
    # a tool wait costs no control call at all (two HTTP calls, the API server's route work and
    # an engine wake-up each, otherwise).
    pause_after: PauseSpec | None = None
    # The implicit pause (issue 41: RL rollouts never call pause): this turn's finish is a pause
    # unless the branch's next request is already queued, predicted with no declared wait, so
    # the wait learned under ``env`` decides. None: the connector's ``implicit_pause`` setting.
    implicit_pause: bool | None = None
    env: ToolName | None = Field(
        default=None,
        description="The environment (or tool) the trajectory's steps run in: the key the "
        f"waits of its implicit pauses are learned under (default {IMPLICIT_PAUSE_ENV!r}).",
    )

    @property
    def pause_env(self) -> str:
        """The tool name of this request's implicit pause."""
        return self.env or IMPLICIT_PAUSE_ENV


@dataclass(frozen=True)
class ParseResult:
    params: AgentKVParams | None
    warning: str | None = None


def parse_request_params(raw: Any) -> ParseResult:
    """Extract agentkv params from a request's kv_transfer_params; never raises.

    No ``agentkv`` key -> (None, None): a vanilla request. Anything malformed -> (None, warning).
    """
    if raw is None:
        return ParseResult(None)
    if not isinstance(raw, dict):
        return ParseResult(None, f"kv_transfer_params must be an object, got {type(raw).__name__}")
    body = raw.get("agentkv")
    if body is None:
        return ParseResult(None)
    if not isinstance(body, dict):
        return ParseResult(
            None, f"kv_transfer_params.agentkv must be an object, got {type(body).__name__}"
        )
    try:
        return ParseResult(AgentKVParams.model_validate(body))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return ParseResult(None, f"invalid kv_transfer_params.agentkv.{where}: {first.get('msg')}")


class IdentitySource(enum.StrEnum):
    """Where the engine found a request's trajectory; the value is the name the turn's stats
    (``identified_by``), the counters and the docs use."""

    PARAMS = "kv_transfer_params.agentkv"
    SESSION_ID = "session_id"
    KV_HINTS = "kv_hints"
    AGENT_HINT = "kv_transfer_params.agent_hint"


ENGINE_PRECEDENCE: tuple[IdentitySource, ...] = tuple(IdentitySource)
# vLLM's typed hints (vllm/v1/kv_hints/protocol.py KvHintAction): agentkv reads the actions of
# this type and version; their payload is a ``kv_transfer_params.agentkv`` object. Other action
# types belong to other components (e.g. the KVCR offload tier) and are skipped.
KV_HINT_ACTION = "agentkv.trajectory"
KV_HINT_VERSION = "1"


class AgentHint(BaseModel):
    """uni-agent's hint (verl-project PR #179): ``kv_transfer_params.agent_hint``."""

    model_config = ConfigDict(extra="ignore")
    trajectory_id: TrajectoryIdStr
    # Not used: vLLM's own request priority is what schedules; kept for the shape.
    priority: float | None = None
    lease_until: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="Unix time (seconds) until which the caller wants the KV kept: caps the "
        "lease of the trajectory's retain decisions.",
    )


@dataclass(frozen=True)
class EngineIdentity:
    """A request's trajectory as the engine resolved it: params None is a vanilla request;
    ``warning`` (with ``kind``, what warn-once dedupes on) says why when a source was
    malformed."""

    params: AgentKVParams | None
    source: IdentitySource | None = None
    warning: str | None = None
    kind: str | None = None
    lease_until: float | None = None


def _invalid(source: IdentitySource, what: str, exc: ValidationError) -> EngineIdentity:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    where = f"{what}.{loc}" if loc else what
    return EngineIdentity(
        None,
        source,
        f"invalid {where}: {first.get('msg')}",
        f"{source.value}:{loc}:{first.get('type')}",
    )


def _malformed(source: IdentitySource, kind: str, message: str) -> EngineIdentity:
    return EngineIdentity(None, source, message, f"{source.value}:{kind}")


def _from_kv_hints(hints: Any) -> EngineIdentity | None:
    """The first agentkv action of a ``KvHintsEnvelope`` (read by attribute: msgspec structs),
    None when it has none."""
    actions = getattr(hints, "actions", None)
    if not isinstance(actions, Sequence):
        return _malformed(IdentitySource.KV_HINTS, "envelope", "kv_hints has no list of actions")
    for action in actions:
        if getattr(action, "action_type", None) != KV_HINT_ACTION:
            continue
        version = getattr(action, "action_version", None)
        if version != KV_HINT_VERSION:
            return _malformed(
                IdentitySource.KV_HINTS,
                "version",
                f"kv_hints action {KV_HINT_ACTION} version {version!r} is not {KV_HINT_VERSION!r}",
            )
        payload = getattr(action, "payload", None)
        if not isinstance(payload, dict):
            return _malformed(
                IdentitySource.KV_HINTS, "payload", "kv_hints action payload must be an object"
            )
        try:
            return EngineIdentity(AgentKVParams.model_validate(payload), IdentitySource.KV_HINTS)
        except ValidationError as exc:
            return _invalid(IdentitySource.KV_HINTS, f"kv_hints.{KV_HINT_ACTION}", exc)
    return None


def resolve_request_identity(
    kv_transfer_params: Any, session_id: Any = None, kv_hints: Any = None
) -> EngineIdentity:
    """The trajectory of a vLLM request from what it carries (the module docstring's order);
    never raises. Nothing present -> a vanilla request without a warning."""
    ktp = kv_transfer_params
    if ktp is not None and not isinstance(ktp, dict):
        return _malformed(
            IdentitySource.PARAMS,
            "type",
            f"kv_transfer_params must be an object, got {type(ktp).__name__}",
        )
    if ktp is not None and ktp.get("agentkv") is not None:
        body = ktp["agentkv"]
        if not isinstance(body, dict):
            return _malformed(
                IdentitySource.PARAMS,
                "type",
                f"kv_transfer_params.agentkv must be an object, got {type(body).__name__}",
            )
        try:
            return EngineIdentity(AgentKVParams.model_validate(body), IdentitySource.PARAMS)
        except ValidationError as exc:
            return _invalid(IdentitySource.PARAMS, "kv_transfer_params.agentkv", exc)
    if session_id is not None:
        try:
            params = AgentKVParams(trajectory_id=session_id)
        except ValidationError as exc:
            return _invalid(IdentitySource.SESSION_ID, "session_id", exc)
        return EngineIdentity(params, IdentitySource.SESSION_ID)
    if kv_hints is not None:
        found = _from_kv_hints(kv_hints)
        if found is not None:
            return found
    if ktp is not None and ktp.get("agent_hint") is not None:
        raw = ktp["agent_hint"]
        if not isinstance(raw, dict):
            return _malformed(
                IdentitySource.AGENT_HINT,
                "type",
                f"kv_transfer_params.agent_hint must be an object, got {type(raw).__name__}",
            )
        try:
            hint = AgentHint.model_validate(raw)
        except ValidationError as exc:
            return _invalid(IdentitySource.AGENT_HINT, "kv_transfer_params.agent_hint", exc)
        return EngineIdentity(
            AgentKVParams(trajectory_id=hint.trajectory_id),
            IdentitySource.AGENT_HINT,
            lease_until=hint.lease_until,
        )
    return EngineIdentity(None)
