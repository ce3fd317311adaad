"""The per-request contract: ``kv_transfer_params = {"agentkv": {...}}``.

Primitives:
  AgentKVParams      validated params (trajectory_id, branch, zones)
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

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
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


class AgentKVParams(BaseModel):
    model_config = ConfigDict(extra="ignore")
    trajectory_id: TrajectoryIdStr
    branch: BranchStr = "main"
    zones: list[Zone] = Field(default_factory=list, max_length=32)
    tool: str | None = Field(default=None, max_length=128)
    # Set only by the plugin's own device-prefetch requests (a random ticket the manager
    # issued); an unknown ticket is served as a vanilla request.
    prefetch: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$")


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
