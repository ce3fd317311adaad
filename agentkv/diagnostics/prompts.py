"""A request rendered as the engine sees it: chat template, tokens, and the zone of every character.

Primitives:
  ChatTokenizer                 what the analysis needs from a tokenizer (render, encode)
  load_tokenizer(model_dir)     HFChatTokenizer over a local model folder (transformers, lazily;
                                once per process)
  render_request(tok, request)  RenderedPrompt: text, token ids, offsets, zone spans
  zone_of(rendered, char)       (zone, message index, offset) of a character of the rendered prompt
  ZONES                         the zones, from the stable head to the newest tail
  lcp, lcp_str, content_text    the longest common prefix, a message's text (shared with causes)

Zones come from message roles and positions: ``system`` (leading system/developer messages),
``tools`` (the rendered tool list), ``history`` (older turns), ``recent`` (the last assistant turn
and what follows it, plus the generation prompt) and ``observation`` (tool results after the last
assistant message). transformers is imported inside ``load_tokenizer`` only.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agentkv.errors import ConfigError

ZONES = ("system", "tools", "history", "recent", "observation")
_TOOL_ROLES = frozenset({"tool", "function", "ipython"})


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


def content_text(message: dict[str, Any]) -> str:
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
        head = lcp_str(bare, text)
        tail = lcp_str(bare[head:][::-1], text[head:][::-1])
        tools_span = (head, len(text) - tail)
    messages = list(request.get("messages") or [])
    zones = _message_zones(messages)
    spans: list[ZoneSpan] = []
    cursor = 0
    for k, msg in enumerate(messages):
        content = content_text(msg)
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


def lcp(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def lcp_str(a: str, b: str) -> int:
    return lcp(a, b)  # type: ignore[arg-type]
