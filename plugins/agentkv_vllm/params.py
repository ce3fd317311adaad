"""The per-request contract: ``kv_transfer_params = {"agentkv": {...}}``.

Primitives:
  AgentKVParams      validated params (trajectory_id, branch, zones, pause_after)
  PauseSpec          a pause's fields (tool or tools, expected_wait_s, max_lease_s): the pause
                     route's body and a request's ``pause_after``
  TrajectoryIdStr, BranchStr   pydantic string types in the id grammar of ``agentkv.ids``
  parse_request_params(raw) -> ParseResult: params or None plus a warning; never raises

Malformed params never fail a request: the request is served like vanilla vLLM and one warning
is logged, because a bad client field must not cost the user their answer. Trajectory ids and
branch names follow ``agentkv.ids`` (no ``/``, so every accepted id is usable in the routes).
"""

from __future__ import annotations

from collections.abc import Callable
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
