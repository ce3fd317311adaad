"""The per-request contract: ``kv_transfer_params = {"agentkv": {...}}``.

Primitives:
  AgentKVParams      validated params (trajectory_id, branch, zones)
  parse_request_params(raw) -> ParseResult: params or None plus a warning; never raises

Malformed params never fail a request: the request is served like vanilla vLLM and one warning
is logged, because a bad client field must not cost the user their answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_ID_LEN = 256


class Zone(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(max_length=64)
    start_token: int | None = Field(default=None, ge=0)
    end_token: int | None = Field(default=None, ge=0)
    start_message: int | None = Field(default=None, ge=0)
    end_message: int | None = Field(default=None, ge=0)


class AgentKVParams(BaseModel):
    model_config = ConfigDict(extra="ignore")
    trajectory_id: str = Field(min_length=1, max_length=MAX_ID_LEN, pattern=r"^[A-Za-z0-9._:@/-]+$")
    branch: str = Field(
        default="main", min_length=1, max_length=MAX_ID_LEN, pattern=r"^[A-Za-z0-9._:@/-]+$"
    )
    zones: list[Zone] = Field(default_factory=list, max_length=32)
    tool: str | None = Field(default=None, max_length=128)


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
