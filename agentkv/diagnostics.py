"""Prefix-stability analysis: where a trajectory's prompt prefix broke, and why.

Primitives:
  load_trajectory(lines)        JSONL -> Trajectory (requests + LineError per malformed line)
  read_trajectory(path)         the same, from a file
  load_tokenizer(model_dir)     HFChatTokenizer over a local model folder (transformers, lazily)
  render_request(tok, request)  RenderedPrompt: text, token ids, offsets, zone spans
  zone_of(rendered, char)       (zone, message index) of a character of the rendered prompt
  classify(prev, cur, ...)      Cause of a break: kind, detail, fix
  diagnose(traj, tok, ...)      DiagnoseReport: per-turn S_prompt, S_match, H_prefix, divergence
  CAUSES                        cause kind -> the fix to make

Input lines are the requests as sent (OpenAI chat format: ``model``, ``messages``, ``tools``) or
the SDK trace export (``{"type": "turn", "request": {...}, "response": {...}}``); a response's
``kv_transfer_params.agentkv`` (the engine's per-turn prefix statistics) is carried along so the
offline replay and the online numbers can be compared turn by turn.

Each prompt is rendered with the model's chat template, tokenized, and replayed through
``prefix_sim.PagedPrefixCache``. The first divergent token is the token-level longest common
prefix with the previous turn's prompt; its zone comes from message roles and positions:
``system`` (leading system/developer messages), ``tools`` (the rendered tool list), ``history``
(older turns), ``recent`` (the last assistant turn and what follows it, plus the generation
prompt) and ``observation`` (tool results after the last assistant message).

transformers is imported inside ``load_tokenizer`` only; the analysis itself needs no torch.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agentkv.errors import ConfigError
from agentkv.prefix_sim import PagedPrefixCache

__all__ = [
    "CAUSES",
    "Cause",
    "ChatTokenizer",
    "DiagnoseReport",
    "Divergence",
    "HFChatTokenizer",
    "LineError",
    "RenderedPrompt",
    "Trajectory",
    "TrajectoryRequest",
    "TurnReport",
    "ZoneSpan",
    "classify",
    "diagnose",
    "load_tokenizer",
    "load_trajectory",
    "read_trajectory",
    "render_request",
    "zone_of",
]

ZONES = ("system", "tools", "history", "recent", "observation")

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
_TOOL_ROLES = frozenset({"tool", "function", "ipython"})


# ---------------------------------------------------------------------------------- input


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


# ---------------------------------------------------------------------------------- rendering


class ChatTokenizer(Protocol):
    """What the analysis needs from a tokenizer."""

    name: str

    def render(self, request: dict[str, Any], tools: list[Any] | None) -> str: ...

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...


class HFChatTokenizer:
    """A transformers tokenizer with its chat template."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self.tok = tokenizer
        self.name = name

    def render(self, request: dict[str, Any], tools: list[Any] | None) -> str:
        kwargs: dict[str, Any] = dict(request.get("chat_template_kwargs") or {})
        cont = bool(request.get("continue_final_message", False))
        add_gen = bool(request.get("add_generation_prompt", not cont))
        text = self.tok.apply_chat_template(
            request.get("messages") or [],
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_gen,
            continue_final_message=cont,
            **kwargs,
        )
        return str(text)

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [(int(a), int(b)) for a, b in enc["offset_mapping"]]


_TOKENIZERS: dict[str, HFChatTokenizer] = {}


def load_tokenizer(model_dir: str | Path) -> HFChatTokenizer:
    """Load (once per process) the tokenizer and chat template of a local model folder."""
    key = str(Path(model_dir).resolve())
    if key in _TOKENIZERS:
        return _TOKENIZERS[key]
    if not Path(key).is_dir():
        raise ConfigError(f"model folder not found: {model_dir}")
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - transformers is a dev dependency
        raise ConfigError("transformers is needed to tokenize: pip install transformers") from exc
    try:
        tok = AutoTokenizer.from_pretrained(key)
    except Exception as exc:
        raise ConfigError(f"cannot load a tokenizer from {model_dir}: {exc}") from exc
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"the tokenizer in {model_dir} has no chat template")
    _TOKENIZERS[key] = HFChatTokenizer(tok, Path(key).name)
    return _TOKENIZERS[key]


@dataclass(frozen=True)
class ZoneSpan:
    """Characters [start, end) of the rendered prompt and the zone (and message) they belong to."""

    zone: str
    message_index: int | None
    start: int
    end: int
    content_start: int = -1  # where the message content begins (-1: the span start)


@dataclass
class RenderedPrompt:
    text: str
    token_ids: list[int]
    offsets: list[tuple[int, int]]
    spans: list[ZoneSpan]


def _content_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return ""


def _message_zones(messages: Sequence[dict[str, Any]]) -> list[str]:
    roles = [str(m.get("role")) for m in messages]
    zones = ["history"] * len(roles)
    i = 0
    while i < len(roles) and roles[i] in ("system", "developer"):
        zones[i] = "system"
        i += 1
    last_asst = max((k for k, r in enumerate(roles) if r == "assistant"), default=-1)
    if last_asst < 0:
        if i < len(roles):
            zones[-1] = "recent" if zones[-1] != "system" else "system"
        return zones
    for k in range(max(last_asst, i), len(roles)):
        zones[k] = "observation" if roles[k] in _TOOL_ROLES else "recent"
    return zones


def render_request(tok: ChatTokenizer, request: dict[str, Any]) -> RenderedPrompt:
    """Render and tokenize one request, and map its characters to zones."""
    tools = list(request.get("tools") or [])
    text = tok.render(request, tools)
    ids, offsets = tok.encode(text)
    tools_span: tuple[int, int] | None = None
    if tools:
        bare = tok.render(request, None)
        head = _lcp_str(bare, text)
        tail = _lcp_str(bare[head:][::-1], text[head:][::-1])
        tools_span = (head, len(text) - tail)
    messages = list(request.get("messages") or [])
    zones = _message_zones(messages)
    spans: list[ZoneSpan] = []
    cursor = 0
    for k, msg in enumerate(messages):
        content = _content_text(msg)
        end = cursor
        begin = cursor
        if content:
            pos = text.find(content, cursor)
            if tools_span and pos >= tools_span[0] and pos < tools_span[1]:
                pos = text.find(content, tools_span[1])
            if pos >= 0:
                begin, end = pos, pos + len(content)
        spans.append(ZoneSpan(zones[k], k, cursor, end, begin))
        cursor = end
    spans.append(ZoneSpan("recent", None, cursor, len(text)))
    if tools_span:
        spans.append(ZoneSpan("tools", None, tools_span[0], tools_span[1]))
    return RenderedPrompt(text, ids, offsets, spans)


def zone_of(rendered: RenderedPrompt, char: int) -> tuple[str, int | None, int]:
    """(zone, message index, offset in the message content or tool list) of character ``char``."""
    for span in rendered.spans:
        if span.zone == "tools" and span.start <= char < span.end:
            return "tools", None, char - span.start
    msg_spans = [s for s in rendered.spans if s.zone != "tools" or s.message_index is not None]
    ends = [s.end for s in msg_spans]
    i = bisect.bisect_right(ends, char)
    # Zero-width spans (empty content) never own a character.
    while i < len(msg_spans) - 1 and msg_spans[i].end <= msg_spans[i].start:
        i += 1
    span = msg_spans[min(i, len(msg_spans) - 1)]
    base = span.content_start if span.content_start >= 0 else span.start
    return span.zone, span.message_index, max(0, char - base)


# ---------------------------------------------------------------------------------- classify


@dataclass(frozen=True)
class Cause:
    """Why a prefix broke, and the fix to make."""

    kind: str
    detail: str
    fix: str


def _cause(kind: str, detail: str) -> Cause:
    return Cause(kind, detail, CAUSES[kind])


def _lcp(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _lcp_str(a: str, b: str) -> int:
    return _lcp(a, b)  # type: ignore[arg-type]


def _mask(text: str) -> str:
    for _, rx in _VOLATILE:
        text = rx.sub("\x00", text)
    return text


def _volatile_kind(a: str, b: str) -> str | None:
    """The kind of volatile value that explains the difference of a and b, if one does."""
    if a == b or _mask(a) != _mask(b):
        return None
    pos = _lcp_str(a, b)
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
    found = _THINK.findall(_content_text(message))
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
        return _cause("serialization", "tool list has the same schemas with another key order")
    names_a, names_b = [_tool_name(t) for t in a], [_tool_name(t) for t in b]
    added = [n for n in names_b if n not in names_a]
    removed = [n for n in names_a if n not in names_b]
    if added or removed:
        parts = []
        if added:
            parts.append("added " + ", ".join(added))
        if removed:
            parts.append("removed " + ", ".join(removed))
        return _cause("tools_changed", "tool list changed: " + "; ".join(parts))
    if names_a != names_b:
        return _cause("tools_changed", "tool list reordered: " + ", ".join(names_b))
    for ta, tb in zip(a, b, strict=False):
        if _canon(ta) != _canon(tb):
            kind = _volatile_kind(_canon(ta), _canon(tb))
            if kind:
                return _cause("volatile_field", f"a {kind} in the schema of tool {_tool_name(tb)}")
            return _cause("tools_changed", f"schema of tool {_tool_name(tb)} edited")
    return _cause("serialization", "tool list rendered differently with equal schemas")


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
        return _cause(
            "history_rewritten",
            f"message {k} ({b_msgs[k].get('role') if k < len(b_msgs) else '?'}) does not continue "
            "the previous prompt: the previous turn's reply was not appended as generated",
        )
    ma = a_msgs[k]
    mb = b_msgs[k] if k < len(b_msgs) else None
    if mb is None:
        return _cause("history_rewritten", f"truncation: messages from {k} on were dropped")
    if _canon(ma) == _canon(mb):
        if any(_reasoning(m) for m in a_msgs + b_msgs):
            return _cause(
                "reasoning_stripped",
                f"message {k} is unchanged but the chat template re-rendered it (reasoning)",
            )
        return _cause("unknown", f"message {k} is unchanged but renders differently")
    ca, cb = _content_text(ma), _content_text(mb)
    if (
        _reasoning(ma)
        and (not _reasoning(mb) or _reasoning(ma) != _reasoning(mb))
        and _THINK.sub("", ca).strip() == _THINK.sub("", cb).strip()
    ):
        return _cause("reasoning_stripped", f"reasoning of message {k} stripped or re-rendered")
    # History rewritten: which shape?
    j = _index_of(b_msgs, ma, k + 1)
    if j > k:
        return _cause("history_rewritten", f"{j - k} message(s) inserted before message {k}")
    later = _index_of(a_msgs, mb, k + 1)
    if later > k:
        return _cause(
            "history_rewritten", f"truncation: {later - k} message(s) dropped at message {k}"
        )
    nxt = b_msgs[k + 1] if k + 1 < len(b_msgs) else None
    resumed = _index_of(a_msgs, nxt, k + 1) if nxt is not None else -1
    if resumed > k + 1:
        return _cause(
            "history_rewritten",
            f"summarization: messages {k}..{resumed - 1} replaced by one message",
        )
    if len(b_msgs) < len(a_msgs) and _index_of(a_msgs, mb, 0) < 0:
        dropped = len(a_msgs) - len(b_msgs) + 1
        if mb.get("role") != ma.get("role"):
            return _cause(
                "history_rewritten",
                f"summarization: about {dropped} message(s) from {k} on replaced by a "
                f"{mb.get('role')} message",
            )
        return _cause(
            "history_rewritten",
            f"truncation: history shrank from {len(a_msgs)} to "
            f"{len(b_msgs)} messages at message {k}",
        )
    if ca != cb:
        if _json_equal(ca, cb) or _ws_equal(ca, cb):
            return _cause(
                "serialization", f"message {k} has the same content with other key order/whitespace"
            )
        kind = _volatile_kind(ca, cb)
        if kind:
            where = "near the head" if zone == "system" or k <= 1 else f"in message {k}"
            return _cause("volatile_field", f"a {kind} {where} changed")
    elif _canon(ma.get("tool_calls")) != _canon(mb.get("tool_calls")):
        calls_a, calls_b = ma.get("tool_calls") or [], mb.get("tool_calls") or []
        if isinstance(calls_a, list) and isinstance(calls_b, list) and len(calls_a) == len(calls_b):
            args_a = [str((c.get("function") or {}).get("arguments", "")) for c in calls_a]
            args_b = [str((c.get("function") or {}).get("arguments", "")) for c in calls_b]
            if all(_json_equal(x, y) or x == y for x, y in zip(args_a, args_b, strict=False)):
                return _cause("serialization", f"tool-call arguments of message {k} re-serialized")
    if len(cb) < len(ca):
        return _cause(
            "history_rewritten", f"compaction: message {k} shortened ({len(ca)} -> {len(cb)} chars)"
        )
    return _cause("history_rewritten", f"message {k} ({mb.get('role')}) edited")


def classify(
    prev: TrajectoryRequest,
    cur: TrajectoryRequest,
    prev_r: RenderedPrompt,
    cur_r: RenderedPrompt,
    token_index: int,
) -> Cause:
    """Why ``cur`` leaves ``prev``'s prompt at ``token_index``."""
    if prev.model != cur.model:
        return _cause("model_switch", f"model {prev.model or '?'} -> {cur.model or '?'}")
    c = _lcp_str(prev_r.text, cur_r.text)
    a_end = prev_r.offsets[token_index][1] if token_index < len(prev_r.offsets) else c
    if c >= len(prev_r.text) or (a_end <= c and c - a_end > 64):
        tok_a = prev_r.token_ids[token_index] if token_index < len(prev_r.token_ids) else None
        tok_b = cur_r.token_ids[token_index] if token_index < len(cur_r.token_ids) else None
        return _cause(
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
        ca, cb = _content_text(a_msgs[k]), _content_text(b_msgs[k])
        kind = _volatile_kind(ca, cb)
        if kind:
            return _cause("volatile_field", f"a {kind} in the system prompt (message {k}) changed")
        if _json_equal(ca, cb) or _ws_equal(ca, cb):
            return _cause("serialization", f"system message {k}: same content, other whitespace")
        if ca != cb:
            return _cause("system_prompt_switch", f"system prompt (message {k}) replaced")
    if k is None:
        k = len(b_msgs)
    return _classify_message(a_msgs, b_msgs, k, zone)


def _tools_first_diff(prev_r: RenderedPrompt, cur_r: RenderedPrompt, c: int) -> bool:
    return any(span.zone == "tools" and span.start <= c <= span.end for span in prev_r.spans)


# ---------------------------------------------------------------------------------- replay


@dataclass
class Divergence:
    """The first token at which a prompt leaves the previous turn's prompt."""

    token_index: int
    zone: str
    message_index: int | None
    char_offset: int  # in the rendered prompt
    message_char_offset: int  # inside the message content (or the tool list)
    prev_token: int | None
    new_token: int | None
    prev_context: tuple[str, str, str]  # before, differing part, after (previous prompt)
    new_context: tuple[str, str, str]  # the same for this prompt
    tokens_lost: int  # reusable tokens the break cost, block-aligned


@dataclass
class TurnReport:
    turn: int
    line_no: int
    model: str
    s_prompt: int
    s_match: int
    s_reusable: int  # block-aligned tokens this prompt shares with the previous one
    h_turn: float
    h_cumulative: float
    divergence: Divergence | None = None
    cause: Cause | None = None
    engine: dict[str, Any] | None = None
    engine_agrees: bool | None = None

    @property
    def broken(self) -> bool:
        return self.cause is not None


@dataclass
class DiagnoseReport:
    tokenizer: str
    block_size: int
    capacity_tokens: int | None
    turns: list[TurnReport]
    errors: list[LineError]

    @property
    def h_prefix(self) -> float:
        total = sum(t.s_prompt for t in self.turns)
        return sum(t.s_match for t in self.turns) / total if total else 0.0

    @property
    def breaks(self) -> list[TurnReport]:
        return [t for t in self.turns if t.broken]

    def to_dict(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for t in self.breaks:
            assert t.cause is not None
            counts[t.cause.kind] = counts.get(t.cause.kind, 0) + 1
        return {
            "tokenizer": self.tokenizer,
            "block_size": self.block_size,
            "capacity_tokens": self.capacity_tokens,
            "turns": [asdict(t) for t in self.turns],
            "h_prefix": round(self.h_prefix, 6),
            "s_prompt_total": sum(t.s_prompt for t in self.turns),
            "s_match_total": sum(t.s_match for t in self.turns),
            "breaks": counts,
            "errors": [asdict(e) for e in self.errors],
        }


def _context(text: str, start: int, end: int, width: int) -> tuple[str, str, str]:
    return text[max(0, start - width) : start], text[start:end], text[end : end + width]


def _engine_agrees(engine: dict[str, Any], report: TurnReport) -> bool | None:
    prompt = engine.get("prompt_tokens")
    if isinstance(prompt, int) and prompt != report.s_prompt:
        return False
    if "first_divergence_token" not in engine:
        return None if not isinstance(prompt, int) else True
    ours = report.divergence.token_index if report.divergence else None
    theirs = engine.get("first_divergence_token")
    if report.cause is not None and report.cause.kind in ("model_switch", "capacity_eviction"):
        return None
    return ours == theirs


def diagnose(
    trajectory: Trajectory,
    tokenizer: ChatTokenizer,
    block_size: int = 128,
    capacity_tokens: int | None = None,
    context_chars: int = 60,
) -> DiagnoseReport:
    """Replay every request through a simulated prefix cache and explain each break."""
    cache = PagedPrefixCache(block_size, capacity_tokens)
    errors = list(trajectory.errors)
    turns: list[TurnReport] = []
    prev: tuple[TrajectoryRequest, RenderedPrompt] | None = None
    sum_prompt = sum_match = 0
    for req in trajectory.requests:
        try:
            rendered = render_request(tokenizer, req.request)
        except Exception as exc:  # a template error is the input's fault: report and skip
            errors.append(LineError(req.line_no, f"chat template failed: {exc}"))
            continue
        ids = rendered.token_ids
        namespace = f"{req.model}\x00{req.request.get('cache_salt') or ''}"
        result = cache.access(ids, namespace)
        sum_prompt += len(ids)
        sum_match += result.matched_tokens
        report = TurnReport(
            turn=len(turns) + 1,
            line_no=req.line_no,
            model=req.model,
            s_prompt=len(ids),
            s_match=result.matched_tokens,
            s_reusable=0,
            h_turn=round(result.matched_tokens / len(ids), 6) if ids else 0.0,
            h_cumulative=round(sum_match / sum_prompt, 6) if sum_prompt else 0.0,
            engine=req.engine,
        )
        if prev is not None:
            p_req, p_r = prev
            reusable = (min(len(p_r.token_ids), len(ids) - 1) // block_size) * block_size
            d = _lcp(p_r.token_ids, ids)
            if p_req.model != req.model:
                d = 0
            report.s_reusable = (min(d, len(ids) - 1) // block_size) * block_size
            if d < len(p_r.token_ids) and d < len(ids):
                cause = classify(p_req, req, p_r, rendered, d)
                lost = max(0, reusable - result.matched_tokens)
                report.divergence = _divergence(p_r, rendered, d, context_chars, lost)
                report.cause = cause
            elif result.matched_tokens < reusable:
                report.cause = _cause(
                    "capacity_eviction",
                    f"prompt unchanged but only {result.matched_tokens} of {reusable} reusable "
                    "tokens were still cached",
                )
        if req.engine:
            report.engine_agrees = _engine_agrees(req.engine, report)
        turns.append(report)
        prev = (req, rendered)
    errors.sort(key=lambda e: e.line_no)
    return DiagnoseReport(tokenizer.name, block_size, capacity_tokens, turns, errors)


def _divergence(
    prev: RenderedPrompt, new: RenderedPrompt, d: int, context_chars: int, tokens_lost: int
) -> Divergence:
    """Where ``new`` leaves ``prev`` at token ``d``: its zone and message, the two tokens and
    ``context_chars`` of text around each side."""
    c_new = new.offsets[d][0]
    zone, k, off = zone_of(new, c_new)
    c = _lcp_str(prev.text, new.text)
    a_start, a_end = prev.offsets[d]
    b_start, b_end = new.offsets[d]
    return Divergence(
        token_index=d,
        zone=zone,
        message_index=k,
        char_offset=c_new,
        message_char_offset=off,
        prev_token=prev.token_ids[d],
        new_token=new.token_ids[d],
        prev_context=_context(
            prev.text, a_start, max(a_end, min(c + 1, len(prev.text))), context_chars
        ),
        new_context=_context(
            new.text, b_start, max(b_end, min(c + 1, len(new.text))), context_chars
        ),
        tokens_lost=tokens_lost,
    )
