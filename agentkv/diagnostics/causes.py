"""Why a prompt prefix broke between two turns, and the fix to make: the diagnosis rules.

Primitives:
  classify(prev, cur, prev_r, cur_r, token_index)  Cause of the break at ``token_index``
  Cause                                            kind, detail, fix
  CAUSES                                           cause kind -> the fix to make
  cause_of(kind, detail)                           a Cause with the kind's fix

The rules, in order: a model switch; the same text tokenized otherwise (a tokenization boundary);
a change in the tool list (added, removed, reordered, a schema edited, a volatile value in a
schema, or only serialization); a system prompt with a volatile value, other whitespace, or
replaced; then the first differing message (``_classify_message``): reasoning stripped, messages
inserted, truncated or summarized, re-serialized content or tool-call arguments, a volatile value,
compaction, or an edit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentkv.diagnostics.prompts import RenderedPrompt, content_text, lcp_str, zone_of
from agentkv.diagnostics.trajectory import TrajectoryRequest

CAUSES: dict[str, str] = {
    "volatile_field": (
        "Move the per-call value (timestamp, date, UUID, counter) out of the stable head: freeze "
        "it per trajectory or send it in the newest message."
    ),
    "tools_changed": (
        "Keep one tool list per trajectory, in a fixed order with frozen schemas; restrict tools "
        "with an instruction or a stable allow-list instead of adding or removing them."
    ),
    "serialization": (
        "Serialize deterministically: json.dumps(..., sort_keys=True, separators=(',', ':')) and "
        "one whitespace policy for schemas, tool-call arguments and observations."
    ),
    "history_rewritten": (
        "Compact rarely and in large batches, append summaries instead of editing earlier turns, "
        "and accept one expensive turn per compaction."
    ),
    "reasoning_stripped": (
        "Send reasoning blocks back exactly as generated (or drop them in the turn that produced "
        "them), and use a chat template that does not re-render earlier turns."
    ),
    "tokenization_boundary": (
        "End every turn on a token boundary the next turn keeps: start new content without "
        "leading whitespace and keep separators inside the message that introduces them."
    ),
    "model_switch": (
        "Keep one model per trajectory: a switch starts from a cold cache. Run the other model's "
        "sub-task as its own trajectory."
    ),
    "system_prompt_switch": (
        "Keep the system prompt fixed for the whole trajectory; put per-phase instructions in a "
        "later message."
    ),
    "capacity_eviction": (
        "The prefix was evicted, not changed: give the pool more blocks (--capacity-tokens) or let "
        "agentkv retain or offload the trajectory across tool waits."
    ),
    "unknown": "Inspect the diff around the divergence; the rendering changed for another reason.",
}

_VOLATILE = [
    (
        "uuid",
        re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"),
    ),
    (
        "timestamp",
        re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{1,2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?"),
    ),
    ("date", re.compile(r"\d{4}-\d{2}-\d{2}|\d{1,2}/\d{1,2}/\d{2,4}")),
    (
        "date",
        re.compile(
            r"\b(Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*,? +\w+ +\d{1,2}(,? +\d{4})?|"
            r"\b\d{1,2} (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* \d{4}"
        ),
    ),
    ("timestamp", re.compile(r"\b\d{1,2}:\d{2}(:\d{2}(\.\d+)?)?\b")),
    ("id", re.compile(r"\b[0-9a-fA-F]{12,}\b")),
    ("counter", re.compile(r"\d+(\.\d+)?")),
]
_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


@dataclass(frozen=True)
class Cause:
    """Why a prefix broke, and the fix to make."""

    kind: str
    detail: str
    fix: str


def cause_of(kind: str, detail: str) -> Cause:
    """A Cause of ``kind`` with the fix ``CAUSES`` names for it."""
    return Cause(kind, detail, CAUSES[kind])


def _mask(text: str) -> str:
    for _, rx in _VOLATILE:
        text = rx.sub("\x00", text)
    return text


def _volatile_kind(a: str, b: str) -> str | None:
    """The kind of volatile value that explains the difference of a and b, if one does."""
    if a == b or _mask(a) != _mask(b):
        return None
    pos = lcp_str(a, b)
    for kind, rx in _VOLATILE:
        for m in rx.finditer(b):
            if m.start() <= pos <= m.end():
                return kind
    return "counter"


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _json_equal(a: str, b: str) -> bool:
    try:
        return _canon(json.loads(a)) == _canon(json.loads(b))
    except (ValueError, TypeError):
        return False


def _ws_equal(a: str, b: str) -> bool:
    return a != b and re.sub(r"\s+", "", a) == re.sub(r"\s+", "", b)


def _reasoning(message: dict[str, Any]) -> str:
    for key in _REASONING_KEYS:
        value = message.get(key)
        if isinstance(value, str) and value:
            return value
    found = _THINK.findall(content_text(message))
    return "".join(found)


def _tool_name(tool: Any) -> str:
    if isinstance(tool, dict):
        fn = tool.get("function")
        if isinstance(fn, dict) and "name" in fn:
            return str(fn["name"])
        if "name" in tool:
            return str(tool["name"])
    return _canon(tool)


def _classify_tools(a: list[Any], b: list[Any]) -> Cause:
    if [_canon(t) for t in a] == [_canon(t) for t in b]:
        return cause_of("serialization", "tool list has the same schemas with another key order")
    names_a, names_b = [_tool_name(t) for t in a], [_tool_name(t) for t in b]
    added = [n for n in names_b if n not in names_a]
    removed = [n for n in names_a if n not in names_b]
    if added or removed:
        parts = []
        if added:
            parts.append("added " + ", ".join(added))
        if removed:
            parts.append("removed " + ", ".join(removed))
        return cause_of("tools_changed", "tool list changed: " + "; ".join(parts))
    if names_a != names_b:
        return cause_of("tools_changed", "tool list reordered: " + ", ".join(names_b))
    for ta, tb in zip(a, b, strict=False):
        if _canon(ta) != _canon(tb):
            kind = _volatile_kind(_canon(ta), _canon(tb))
            if kind:
                return cause_of(
                    "volatile_field", f"a {kind} in the schema of tool {_tool_name(tb)}"
                )
            return cause_of("tools_changed", f"schema of tool {_tool_name(tb)} edited")
    return cause_of("serialization", "tool list rendered differently with equal schemas")


def _index_of(messages: Sequence[dict[str, Any]], target: dict[str, Any], start: int) -> int:
    want = _canon(target)
    for j in range(start, len(messages)):
        if _canon(messages[j]) == want:
            return j
    return -1


def _classify_message(
    a_msgs: list[dict[str, Any]], b_msgs: list[dict[str, Any]], k: int, zone: str
) -> Cause:
    if k >= len(a_msgs):
        return cause_of(
            "history_rewritten",
            f"message {k} ({b_msgs[k].get('role') if k < len(b_msgs) else '?'}) does not continue "
            "the previous prompt: the previous turn's reply was not appended as generated",
        )
    ma = a_msgs[k]
    mb = b_msgs[k] if k < len(b_msgs) else None
    if mb is None:
        return cause_of("history_rewritten", f"truncation: messages from {k} on were dropped")
    if _canon(ma) == _canon(mb):
        if any(_reasoning(m) for m in a_msgs + b_msgs):
            return cause_of(
                "reasoning_stripped",
                f"message {k} is unchanged but the chat template re-rendered it (reasoning)",
            )
        return cause_of("unknown", f"message {k} is unchanged but renders differently")
    ca, cb = content_text(ma), content_text(mb)
    if (
        _reasoning(ma)
        and (not _reasoning(mb) or _reasoning(ma) != _reasoning(mb))
        and _THINK.sub("", ca).strip() == _THINK.sub("", cb).strip()
    ):
        return cause_of("reasoning_stripped", f"reasoning of message {k} stripped or re-rendered")
    # History rewritten: which shape?
    j = _index_of(b_msgs, ma, k + 1)
    if j > k:
        return cause_of("history_rewritten", f"{j - k} message(s) inserted before message {k}")
    later = _index_of(a_msgs, mb, k + 1)
    if later > k:
        return cause_of(
            "history_rewritten", f"truncation: {later - k} message(s) dropped at message {k}"
        )
    nxt = b_msgs[k + 1] if k + 1 < len(b_msgs) else None
    resumed = _index_of(a_msgs, nxt, k + 1) if nxt is not None else -1
    if resumed > k + 1:
        return cause_of(
            "history_rewritten",
            f"summarization: messages {k}..{resumed - 1} replaced by one message",
        )
    if len(b_msgs) < len(a_msgs) and _index_of(a_msgs, mb, 0) < 0:
        dropped = len(a_msgs) - len(b_msgs) + 1
        if mb.get("role") != ma.get("role"):
            return cause_of(
                "history_rewritten",
                f"summarization: about {dropped} message(s) from {k} on replaced by a "
                f"{mb.get('role')} message",
            )
        return cause_of(
            "history_rewritten",
            f"truncation: history shrank from {len(a_msgs)} to "
            f"{len(b_msgs)} messages at message {k}",
        )
    if ca != cb:
        if _json_equal(ca, cb) or _ws_equal(ca, cb):
            return cause_of(
                "serialization", f"message {k} has the same content with other key order/whitespace"
            )
        kind = _volatile_kind(ca, cb)
        if kind:
            where = "near the head" if zone == "system" or k <= 1 else f"in message {k}"
            return cause_of("volatile_field", f"a {kind} {where} changed")
    elif _canon(ma.get("tool_calls")) != _canon(mb.get("tool_calls")):
        calls_a, calls_b = ma.get("tool_calls") or [], mb.get("tool_calls") or []
        if isinstance(calls_a, list) and isinstance(calls_b, list) and len(calls_a) == len(calls_b):
            args_a = [str((c.get("function") or {}).get("arguments", "")) for c in calls_a]
            args_b = [str((c.get("function") or {}).get("arguments", "")) for c in calls_b]
            if all(_json_equal(x, y) or x == y for x, y in zip(args_a, args_b, strict=False)):
                return cause_of(
                    "serialization", f"tool-call arguments of message {k} re-serialized"
                )
    if len(cb) < len(ca):
        return cause_of(
            "history_rewritten", f"compaction: message {k} shortened ({len(ca)} -> {len(cb)} chars)"
        )
    return cause_of("history_rewritten", f"message {k} ({mb.get('role')}) edited")


def classify(
    prev: TrajectoryRequest,
    cur: TrajectoryRequest,
    prev_r: RenderedPrompt,
    cur_r: RenderedPrompt,
    token_index: int,
) -> Cause:
    """Why ``cur`` leaves ``prev``'s prompt at ``token_index``."""
    if prev.model != cur.model:
        return cause_of("model_switch", f"model {prev.model or '?'} -> {cur.model or '?'}")
    c = lcp_str(prev_r.text, cur_r.text)
    a_end = prev_r.offsets[token_index][1] if token_index < len(prev_r.offsets) else c
    if c >= len(prev_r.text) or (a_end <= c and c - a_end > 64):
        tok_a = prev_r.token_ids[token_index] if token_index < len(prev_r.token_ids) else None
        tok_b = cur_r.token_ids[token_index] if token_index < len(cur_r.token_ids) else None
        return cause_of(
            "tokenization_boundary",
            f"same text, other tokens at token {token_index} ({tok_a} -> {tok_b}): the new text "
            "merged with the end of the previous prompt",
        )
    zone, k, _ = zone_of(cur_r, c)
    if zone == "tools":
        return _classify_tools(prev.tools, cur.tools)
    if prev.tools != cur.tools and _tools_first_diff(prev_r, cur_r, c):
        return _classify_tools(prev.tools, cur.tools)
    a_msgs, b_msgs = prev.messages, cur.messages
    if zone == "system" and k is not None and k < len(a_msgs):
        ca, cb = content_text(a_msgs[k]), content_text(b_msgs[k])
        kind = _volatile_kind(ca, cb)
        if kind:
            return cause_of(
                "volatile_field", f"a {kind} in the system prompt (message {k}) changed"
            )
        if _json_equal(ca, cb) or _ws_equal(ca, cb):
            return cause_of("serialization", f"system message {k}: same content, other whitespace")
        if ca != cb:
            return cause_of("system_prompt_switch", f"system prompt (message {k}) replaced")
    if k is None:
        k = len(b_msgs)
    return _classify_message(a_msgs, b_msgs, k, zone)


def _tools_first_diff(prev_r: RenderedPrompt, cur_r: RenderedPrompt, c: int) -> bool:
    return any(span.zone == "tools" and span.start <= c <= span.end for span in prev_r.spans)
