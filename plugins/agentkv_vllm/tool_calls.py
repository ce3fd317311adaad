"""The tool calls in a response of each API the auto-pause watches, as the API server writes it.

Primitives:
  Api                         the watched routes (StrEnum of their paths)
  tool_names_from_payload(payload, api, streamed)   tool names in one parsed response / SSE event
  tool_names_from_json(raw, api)                    tool names of a non-streamed response body
  SSEToolScanner(api)         fed a response's SSE bytes: tool names (once per call), the
                              Responses API's response id and final ``output``, and ``done`` at
                              the API's last event

Where each API puts a call (non-streamed / streamed):
  chat completions   ``choices[].message.tool_calls[].function.name`` /
                     ``choices[].delta.tool_calls[].function.name``; last event ``data: [DONE]``
  responses          ``output[]`` items of type ``function_call`` (or ``custom_tool_call``),
                     ``.name`` / the same items in ``response.output_item.added|done`` events
                     (one call per ``output_index``); last event ``response.completed``,
                     ``response.incomplete``, ``response.failed`` or ``error``
  messages           ``content[]`` blocks of type ``tool_use``, ``.name`` /
                     ``content_block_start`` events whose ``content_block`` is a ``tool_use``;
                     last event ``message_stop`` or ``error``
  completions        none (no tools)

Nothing here raises on odd input: what is not the expected shape holds no tool call.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from enum import StrEnum
from typing import Any

MAX_SSE_LINE = 4 * 1024 * 1024


class Api(StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    RESPONSES = "/v1/responses"
    MESSAGES = "/v1/messages"


RESPONSES_CALL_TYPES = frozenset({"function_call", "custom_tool_call"})
RESPONSES_ITEM_EVENTS = frozenset({"response.output_item.added", "response.output_item.done"})
_LAST_EVENTS = {
    Api.RESPONSES: frozenset(
        {"response.completed", "response.incomplete", "response.failed", "error"}
    ),
    Api.MESSAGES: frozenset({"message_stop", "error"}),
}
# Bytes an SSE event of interest contains (others are not parsed).
_SCAN_MARKERS = {
    Api.RESPONSES: (
        b"response.created",
        b"output_item",
        b'"error"',
        *(e.encode() for e in _LAST_EVENTS[Api.RESPONSES]),
    ),
    Api.MESSAGES: (b"content_block_start", b"message_stop", b'"error"'),
}
# Bytes a response must contain to hold a call (a substring search spares the JSON parse).
_MARKERS = {
    Api.CHAT: b"tool_calls",
    Api.COMPLETIONS: b"tool_calls",
    Api.RESPONSES: b"_call",
    Api.MESSAGES: b"tool_use",
}


def _name(obj: object) -> str | None:
    name = obj.get("name") if isinstance(obj, dict) else None
    return name if isinstance(name, str) and name else None


def _chat_calls(calls: object) -> Iterable[str]:
    if not isinstance(calls, list):
        return
    for call in calls:
        name = _name(call.get("function") if isinstance(call, dict) else None)
        if name:
            yield name


def _chat_names(payload: dict[str, Any], key: str) -> list[str]:
    names: list[str] = []
    choices = payload.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        part = choice.get(key) if isinstance(choice, dict) else None
        if isinstance(part, dict):
            names.extend(_chat_calls(part.get("tool_calls")))
    return names


def _typed_names(items: object, types: frozenset[str]) -> list[str]:
    out: list[str] = []
    for item in items if isinstance(items, list) else ():
        if isinstance(item, dict) and item.get("type") in types and (name := _name(item)):
            out.append(name)
    return out


def tool_names_from_payload(payload: object, api: Api, streamed: bool = False) -> list[str]:
    """Tool names in one parsed response (``streamed`` False) or chat SSE chunk (True).
    Responses / Messages SSE events go through ``SSEToolScanner`` (they need per-call dedup)."""
    if not isinstance(payload, dict):
        return []
    if api in (Api.CHAT, Api.COMPLETIONS):
        return _chat_names(payload, "delta" if streamed else "message")
    if api == Api.RESPONSES:
        return _typed_names(payload.get("output"), RESPONSES_CALL_TYPES)
    return _typed_names(payload.get("content"), frozenset({"tool_use"}))


def tool_names_from_json(raw: bytes, api: Api = Api.CHAT) -> list[str]:
    """Tool calls of a non-streamed response; [] for anything else."""
    if _MARKERS[api] not in raw:
        return []
    try:
        payload = json.loads(raw)
    except ValueError:
        return []
    return tool_names_from_payload(payload, api)


class SSEToolScanner:
    """Feeds on a response's SSE bytes; collects tool names, notices the API's last event."""

    def __init__(self, api: Api = Api.CHAT) -> None:
        self.api = api
        self.done = False
        self.response_id: str | None = None  # the Responses API's id (``response.created``)
        # The Responses API's final ``output`` (the last event's response): what a client that
        # resends its history replays (the streamed items may carry other call ids).
        self.output: list[Any] | None = None
        self._calls: dict[object, str] = {}  # one name per call (output_index / block index)
        self._chat: list[str] = []
        self._buf = b""

    @property
    def names(self) -> list[str]:
        return self._chat if self.api in (Api.CHAT, Api.COMPLETIONS) else list(self._calls.values())

    def feed(self, chunk: bytes) -> None:
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        if len(self._buf) > MAX_SSE_LINE:  # not SSE as vLLM writes it; stop looking
            self._buf = b""
        for line in lines:
            self._line(line.rstrip(b"\r"))

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if self.api in (Api.CHAT, Api.COMPLETIONS):
            self._chat_line(data)
            return
        if not any(m in data for m in _SCAN_MARKERS[self.api]):
            return  # text deltas, the bulk of a stream, are never parsed
        event = _loads(data)
        if not isinstance(event, dict):
            return
        kind = event.get("type")
        if kind == "response.created" and self.response_id is None:
            response = event.get("response")
            rid = response.get("id") if isinstance(response, dict) else None
            self.response_id = rid if isinstance(rid, str) else None
        elif kind in _LAST_EVENTS[self.api]:
            self.done = True
            response = event.get("response")
            output = response.get("output") if isinstance(response, dict) else None
            self.output = output if isinstance(output, list) else None
        elif self.api == Api.RESPONSES and kind in RESPONSES_ITEM_EVENTS:
            item = event.get("item")
            name = _name(item)
            if name and isinstance(item, dict) and item.get("type") in RESPONSES_CALL_TYPES:
                self._calls[event.get("output_index", item.get("id"))] = name
        elif self.api == Api.MESSAGES and kind == "content_block_start":
            block = event.get("content_block")
            name = _name(block)
            if name and isinstance(block, dict) and block.get("type") == "tool_use":
                self._calls[event.get("index", len(self._calls))] = name

    def _chat_line(self, data: bytes) -> None:
        if data == b"[DONE]":
            self.done = True
            return
        if b"tool_calls" not in data:
            return
        self._chat.extend(tool_names_from_payload(_loads(data), self.api, streamed=True))


def _loads(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


__all__ = ["Api", "SSEToolScanner", "tool_names_from_json", "tool_names_from_payload"]
