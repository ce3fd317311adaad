"""Zones, canonical rendering and the layout lint.

Primitives:
  ZONES                    zone names in ascending volatility: system, tools, memory, recent, observation
  STABLE_ZONES             the zones whose change breaks the cache for everything after them
  canonical_json(obj)      deterministic JSON: sorted keys, fixed separators, no NaN, UTF-8 kept
  freeze_tools(tools)      tool definitions canonicalized and sorted by name (a stable order)
  lint_volatile(text)      findings of volatile data (timestamps, UUIDs, request ids, epochs)
  lint_context(rendered)   those findings for the stable zones of a rendering
  check_stability(a, b)    the stable zones that changed from rendering ``a`` to ``b``
  ZoneChange               one stable zone that changed between turns, with its unified diff
  Context                  the zoned context of one branch; ``render()`` -> RenderedContext
  RenderedContext          messages, tools and zone boundaries (message indices, end exclusive)

A turn's prompt is ``system | tools | memory | recent | observation``. Only appending keeps the
prefix cache warm: system and tools must stay byte-identical, memory may only grow at its end, and
recent/observation are expected to move. ``Context.check_stability`` compares two renderings and
reports every stable zone whose old rendering is not a prefix of (or equal to) its new one.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from harness_sdk.errors import LayoutError

ZoneName = Literal["system", "tools", "memory", "recent", "observation"]
ZONES: tuple[ZoneName, ...] = ("system", "tools", "memory", "recent", "observation")
STABLE_ZONES: tuple[ZoneName, ...] = ("system", "tools", "memory")
Message = dict[str, Any]


def canonical_json(obj: Any) -> str:
    """Deterministic JSON: keys sorted at every level, ``(",", ":")`` separators, no NaN."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def _sorted_copy(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _sorted_copy(obj[k]) for k in sorted(obj, key=str)}
    if isinstance(obj, (list, tuple)):
        return [_sorted_copy(v) for v in obj]
    return obj


def _tool_name(tool: Mapping[str, Any]) -> str:
    fn = tool.get("function")
    if isinstance(fn, Mapping) and "name" in fn:
        return str(fn["name"])
    if "name" in tool:
        return str(tool["name"])
    raise LayoutError(f"tool definition without a name: {canonical_json(_sorted_copy(tool))[:120]}")


def freeze_tools(tools: Iterable[Mapping[str, Any]]) -> tuple[dict[str, Any], ...]:
    """Canonicalize tool definitions (keys sorted recursively) and sort them by name.

    Accepts OpenAI (``{"type": "function", "function": {...}}``) or bare ``{"name", ...}`` shapes.
    Duplicate names are an error: the order would otherwise depend on insertion.
    """
    frozen = [_sorted_copy(dict(t)) for t in tools]
    names = [_tool_name(t) for t in frozen]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise LayoutError(f"duplicate tool names: {dupes}")
    return tuple(t for _, t in sorted(zip(names, frozen, strict=True), key=lambda p: p[0]))


# --- lint ---------------------------------------------------------------------------------------

_VOLATILE_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "iso_timestamp",
        re.compile(r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?\b"),
    ),
    ("date", re.compile(r"\b(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])\b")),
    ("clock_time", re.compile(r"\b([01]\d|2[0-3]):[0-5]\d:[0-5]\d\b")),
    (
        "uuid",
        re.compile(
            r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
        ),
    ),
    (
        "request_id",
        re.compile(
            r"\b(req|request|chatcmpl|msg|run|trace|span)[-_][A-Za-z0-9]{8,}\b", re.IGNORECASE
        ),
    ),
    ("hex_id", re.compile(r"\b[0-9a-f]{24,}\b")),
    ("unix_epoch", re.compile(r"\b1[5-9]\d{8}(\d{3})?\b")),
)


@dataclass(frozen=True)
class LintFinding:
    """Volatile data found in a stable zone."""

    zone: str
    kind: str
    match: str

    def __str__(self) -> str:
        return f"{self.zone}: {self.kind} {self.match!r}"


def lint_volatile(text: str, zone: str = "") -> list[LintFinding]:
    """Findings of volatile-looking data in ``text`` (one per distinct match, first kind wins)."""
    found: list[LintFinding] = []
    seen_spans: list[tuple[int, int]] = []
    for kind, pattern in _VOLATILE_PATTERNS:
        for m in pattern.finditer(text):
            if any(s <= m.start() < e for s, e in seen_spans):
                continue
            seen_spans.append(m.span())
            found.append(LintFinding(zone, kind, m.group(0)))
    return found


# --- change detection ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ZoneChange:
    """A stable zone that changed between two turns, with a unified diff of its rendering."""

    zone: str
    diff: str
    turn: int = 0

    def __str__(self) -> str:
        return f"stable zone {self.zone!r} changed before turn {self.turn}:\n{self.diff}"


def _zone_lines(items: Sequence[Any]) -> list[str]:
    return [canonical_json(i) for i in items]


def zone_diff(zone: str, old: Sequence[Any], new: Sequence[Any], max_lines: int = 40) -> str:
    """Unified diff of two renderings of a zone (one canonical JSON line per item), truncated."""
    lines = list(
        difflib.unified_diff(
            _zone_lines(old),
            _zone_lines(new),
            f"{zone}@previous",
            f"{zone}@current",
            lineterm="",
            n=1,
        )
    )
    if len(lines) > max_lines:
        lines = [*lines[:max_lines], f"... ({len(lines) - max_lines} more diff lines)"]
    return "\n".join(lines)


# --- the zoned context --------------------------------------------------------------------------


def _check_message(msg: Mapping[str, Any]) -> Message:
    if not isinstance(msg, Mapping) or "role" not in msg:
        raise LayoutError(f"a message needs a 'role': {msg!r}")
    return _sorted_copy(dict(msg))  # type: ignore[no-any-return]


@dataclass
class RenderedContext:
    """One turn's rendering: the messages, frozen tools and zone boundaries.

    ``boundaries[zone] = (start_message, end_message)``, end exclusive; an empty zone has
    ``start == end``. With ``tools_as="param"`` the tools zone is empty in message terms and sits
    right after the system message, where chat templates render the tool list.
    """

    messages: list[Message]
    tools: tuple[dict[str, Any], ...]
    boundaries: dict[str, tuple[int, int]]
    system: str | None
    zone_items: dict[str, list[Any]] = field(default_factory=dict)

    def zones_param(self) -> list[dict[str, Any]]:
        """The ``zones`` list of ``kv_transfer_params.agentkv`` (message indices, end exclusive)."""
        return [
            {"name": z, "start_message": s, "end_message": e}
            for z, (s, e) in self.boundaries.items()
        ]

    def zone_of_message(self, index: int) -> str | None:
        """The zone a message index falls into, or None past the end."""
        for z, (s, e) in self.boundaries.items():
            if s <= index < e:
                return z
        return None


class Context:
    """The zoned context of one branch.

    ``system`` and ``tools`` are set whole; ``memory`` holds long-lived messages (facts, summaries)
    and the history that aged out of ``recent``; ``recent`` holds the last ``recent_turns`` turns;
    ``observation`` holds what arrived since the last turn (the user's message, tool output).
    After a turn, observation and the reply move to recent; the oldest turns then age into memory,
    which keeps the token order unchanged (aging never breaks the prefix).
    """

    def __init__(
        self,
        system: str | None = None,
        tools: Iterable[Mapping[str, Any]] = (),
        memory: Iterable[Mapping[str, Any]] = (),
        *,
        recent_turns: int = 4,
        tools_as: Literal["param", "message"] = "param",
    ) -> None:
        if recent_turns < 0:
            raise LayoutError("recent_turns must be >= 0")
        if tools_as not in ("param", "message"):
            raise LayoutError(f"tools_as must be 'param' or 'message', got {tools_as!r}")
        self.system = system
        self.tools = freeze_tools(tools)
        self.memory: list[Message] = [_check_message(m) for m in memory]
        self.turns: list[
            list[Message]
        ] = []  # completed turns, oldest first (each: observation + reply)
        self.observation: list[Message] = []
        self.recent_turns = recent_turns
        self.tools_as = tools_as

    def copy(self) -> Context:
        """A deep copy (a fork shares the prefix but not later changes)."""
        return copy.deepcopy(self)

    def set_tools(self, tools: Iterable[Mapping[str, Any]]) -> None:
        self.tools = freeze_tools(tools)

    def remember(self, content: str, role: str = "user") -> None:
        """Append a long-lived message to memory (breaks the prefix after memory if turns exist)."""
        self.memory.append(_check_message({"role": role, "content": content}))

    def observe(
        self,
        content: str | None = None,
        *,
        role: str = "user",
        message: Mapping[str, Any] | None = None,
    ) -> None:
        """Add a message to the observation zone (sent with the next turn)."""
        self.observation.append(
            _check_message(
                message if message is not None else {"role": role, "content": content or ""}
            )
        )

    def commit_turn(self, reply: Mapping[str, Any]) -> None:
        """Move the observation and the assistant's reply into the history."""
        self.turns.append([*self.observation, _check_message(reply)])
        self.observation = []

    def render(self) -> RenderedContext:
        msgs: list[Message] = []
        bounds: dict[str, tuple[int, int]] = {}
        start = 0
        if self.system is not None:
            msgs.append({"content": self.system, "role": "system"})
        bounds["system"] = (start, len(msgs))
        start = len(msgs)
        if self.tools and self.tools_as == "message":
            msgs.append(
                {
                    "content": "Available tools:\n" + canonical_json(list(self.tools)),
                    "role": "system",
                }
            )
        bounds["tools"] = (start, len(msgs))
        start = len(msgs)
        split = max(0, len(self.turns) - self.recent_turns)
        aged = [m for t in self.turns[:split] for m in t]
        msgs.extend(self.memory)
        msgs.extend(aged)
        bounds["memory"] = (start, len(msgs))
        start = len(msgs)
        recent = [m for t in self.turns[split:] for m in t]
        msgs.extend(recent)
        bounds["recent"] = (start, len(msgs))
        start = len(msgs)
        msgs.extend(self.observation)
        bounds["observation"] = (start, len(msgs))
        items: dict[str, list[Any]] = {
            "system": [] if self.system is None else [self.system],
            "tools": list(self.tools),
            "memory": [*self.memory, *aged],
            "recent": recent,
            "observation": list(self.observation),
            "_memory_pinned": list(self.memory),
        }
        return RenderedContext(copy.deepcopy(msgs), self.tools, bounds, self.system, items)


def check_stability(
    old: RenderedContext | None, new: RenderedContext, turn: int = 0
) -> list[ZoneChange]:
    """Stable zones whose rendering changed: system/tools must be equal, memory may only grow."""
    if old is None:
        return []
    changes: list[ZoneChange] = []
    for zone in STABLE_ZONES:
        a, b = old.zone_items.get(zone, []), new.zone_items.get(zone, [])
        ok = a == b if zone != "memory" else b[: len(a)] == a
        if not ok:
            changes.append(ZoneChange(zone, zone_diff(zone, a, b), turn))
    return changes


def lint_context(rendered: RenderedContext) -> list[LintFinding]:
    """Volatile-data findings in the stable zones of a rendering."""
    findings: list[LintFinding] = []
    for zone in STABLE_ZONES:
        # Aged history is already cached as written; only what the harness pins is linted.
        key = "_memory_pinned" if zone == "memory" else zone
        for item in rendered.zone_items.get(key, []):
            text = item if isinstance(item, str) else canonical_json(item)
            findings.extend(lint_volatile(text, zone))
    return findings
