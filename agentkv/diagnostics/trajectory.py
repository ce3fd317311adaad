"""The trajectory a diagnosis reads: one JSONL line per request, malformed lines named and skipped.

Primitives:
  load_trajectory(lines)   JSONL -> Trajectory (requests + LineError per malformed line)
  read_trajectory(path)    the same, from a file; ConfigError when it cannot be read
  Trajectory               the requests in order and the errors
  TrajectoryRequest        one request as sent (``model``, ``messages``, ``tools``) and the
                           engine's per-turn prefix statistics when the trace recorded them
  LineError                a malformed line: its number and what is wrong

Input lines are the requests as sent (OpenAI chat format) or the SDK trace export
(``{"type": "turn", "request": {...}, "response": {...}}``); a response's
``kv_transfer_params.agentkv`` is carried along so the offline replay and the online numbers can
be compared turn by turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentkv.errors import ConfigError


@dataclass(frozen=True)
class LineError:
    """A malformed input line, skipped."""

    line_no: int
    message: str


@dataclass
class TrajectoryRequest:
    """One request of the trajectory as sent, with the engine's stats for it when recorded."""

    line_no: int
    request: dict[str, Any]
    engine: dict[str, Any] | None = None

    @property
    def model(self) -> str:
        return str(self.request.get("model") or "")

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.request.get("messages") or [])

    @property
    def tools(self) -> list[Any]:
        return list(self.request.get("tools") or [])


@dataclass
class Trajectory:
    requests: list[TrajectoryRequest] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)


def _check_request(req: Any) -> str | None:
    if not isinstance(req, dict):
        return f"request must be a JSON object, got {type(req).__name__}"
    msgs = req.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return "request has no 'messages' list"
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"messages[{i}] is not an object with a 'role'"
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            return f"messages[{i}].content must be a string, a list of parts or null"
    tools = req.get("tools")
    if tools is not None and not isinstance(tools, list):
        return "'tools' must be a list"
    return None


def _engine_stats(response: Any) -> dict[str, Any] | None:
    if not isinstance(response, dict):
        return None
    params = response.get("kv_transfer_params")
    if isinstance(params, dict) and isinstance(params.get("agentkv"), dict):
        return dict(params["agentkv"])
    return None


def load_trajectory(lines: Iterable[str]) -> Trajectory:
    """Parse JSONL lines; blank lines and non-turn trace records are skipped silently."""
    traj = Trajectory()
    for line_no, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            traj.errors.append(LineError(line_no, f"invalid JSON: {exc.msg} (column {exc.colno})"))
            continue
        if not isinstance(obj, dict):
            traj.errors.append(
                LineError(line_no, f"expected a JSON object, got {type(obj).__name__}")
            )
            continue
        engine = None
        if "type" in obj and "messages" not in obj:
            if obj.get("type") != "turn":
                continue  # other trace records (spans, pauses) carry no prompt
            req = obj.get("request")
            engine = _engine_stats(obj.get("response"))
        else:
            req = obj
            engine = _engine_stats(obj.get("response"))
        problem = _check_request(req)
        if problem:
            traj.errors.append(LineError(line_no, problem))
            continue
        assert isinstance(req, dict)
        traj.requests.append(TrajectoryRequest(line_no, req, engine))
    return traj


def read_trajectory(path: str | Path) -> Trajectory:
    """``load_trajectory`` over a file; ConfigError when it cannot be read."""
    p = Path(path)
    try:
        with p.open(encoding="utf-8", errors="replace") as fh:
            return load_trajectory(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read trajectory {p}: {exc.strerror or exc}") from exc
