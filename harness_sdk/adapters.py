"""Provider adapters: one zoned context -> a provider's request; its response -> the same stats.

Primitives:
  CacheUsage          input/output/cached/cache-creation tokens of a turn; ``hit_ratio``
  ParsedTurn          the reply message, usage, engine stats and response metadata
  Adapter             the interface: ``build_request``, ``parse_response``, ``headers``
  AgentKVAdapter      vLLM + agentkv plugin: chat/completions with ``kv_transfer_params.agentkv``
                      (the default; the only one that uses the agentkv control routes)
  OpenAIAdapter       OpenAI chat/completions: ``prompt_cache_key``; ``prompt_tokens_details``
  AnthropicAdapter    Anthropic Messages: zones -> ``cache_control`` breakpoints (at most 4, at
                      zone boundaries: tools, system, memory, recent); ``cache_*_input_tokens``

``CacheUsage.input_tokens`` always counts every prompt token, cached or not (Anthropic's own
``input_tokens`` excludes cached ones; it is summed back here), so the telemetry compares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from harness_sdk.zones import RenderedContext


@dataclass(frozen=True)
class CacheUsage:
    """Token usage of one turn, normalized across providers."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    cache_creation_tokens: int | None = None

    @property
    def hit_ratio(self) -> float | None:
        if not self.input_tokens or self.cached_tokens is None:
            return None
        return min(1.0, self.cached_tokens / self.input_tokens)


@dataclass
class ParsedTurn:
    """A provider response reduced to what a trajectory needs."""

    message: dict[str, Any]
    content: str
    usage: CacheUsage
    engine: dict[str, Any] | None = None
    response_model: str | None = None
    response_id: str | None = None
    finish_reasons: list[str] = field(default_factory=list)


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(b.get("text", "")) for b in content if isinstance(b, dict))
    return str(content)


# The session header every call carries (the routing contract; vllm-router keys affinity on it).
SESSION_HEADER = "x-session-id"


class Adapter:
    """Base adapter. Subclasses set ``provider`` and ``path`` and fill the two hooks."""

    provider: ClassVar[str] = "unknown"
    path: ClassVar[str] = "/v1/chat/completions"
    supports_control: ClassVar[bool] = False

    def headers(self, api_key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def build_request(
        self,
        rendered: RenderedContext,
        *,
        model: str,
        trajectory_id: str,
        branch: str,
        max_tokens: int | None,
        temperature: float | None,
        extra: dict[str, Any] | None,
        pause_after: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The request body. ``pause_after`` (the pause that follows this turn: tool,
        expected_wait_s) is sent only by an adapter whose server applies it (agentkv's)."""
        raise NotImplementedError

    def parse_response(self, body: dict[str, Any]) -> ParsedTurn:
        raise NotImplementedError


class OpenAIAdapter(Adapter):
    """OpenAI-compatible chat/completions. ``prompt_cache_key`` = the trajectory id (all branches
    share the prefix, so they should land on the same cache)."""

    provider: ClassVar[str] = "openai"

    def __init__(self, *, prompt_cache_key: bool = True) -> None:
        self.prompt_cache_key = prompt_cache_key

    def build_request(
        self,
        rendered: RenderedContext,
        *,
        model: str,
        trajectory_id: str,
        branch: str,
        max_tokens: int | None,
        temperature: float | None,
        extra: dict[str, Any] | None,
        pause_after: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "messages": rendered.messages}
        start, end = rendered.boundaries["tools"]
        if rendered.tools and start == end:  # tools_as="param": the template renders them
            body["tools"] = list(rendered.tools)
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if temperature is not None:
            body["temperature"] = temperature
        if self.prompt_cache_key:
            body["prompt_cache_key"] = trajectory_id
        body.update(extra or {})
        return body

    def parse_response(self, body: dict[str, Any]) -> ParsedTurn:
        choices = body.get("choices") or [{}]
        first = choices[0] if isinstance(choices[0], dict) else {}
        msg = first.get("message") or {}
        content = _text(msg.get("content"))
        reply: dict[str, Any] = {"role": msg.get("role") or "assistant", "content": content}
        if msg.get("tool_calls"):
            reply["tool_calls"] = msg["tool_calls"]
        usage = body.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        cu = CacheUsage(
            input_tokens=_int(usage.get("prompt_tokens")),
            output_tokens=_int(usage.get("completion_tokens")),
            cached_tokens=_int(details.get("cached_tokens")) if details else None,
        )
        reasons = [
            str(c.get("finish_reason"))
            for c in choices
            if isinstance(c, dict) and c.get("finish_reason")
        ]
        return ParsedTurn(reply, content, cu, None, body.get("model"), body.get("id"), reasons)


class AgentKVAdapter(OpenAIAdapter):
    """vLLM with the agentkv plugin: sends ``kv_transfer_params.agentkv`` (trajectory id, branch,
    zone boundaries as message indices) and reads the engine's per-turn stats back."""

    provider: ClassVar[str] = "vllm"
    supports_control: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__(prompt_cache_key=False)

    def build_request(
        self,
        rendered: RenderedContext,
        *,
        model: str,
        trajectory_id: str,
        branch: str,
        max_tokens: int | None,
        temperature: float | None,
        extra: dict[str, Any] | None,
        pause_after: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        extra = dict(extra or {})
        kv_extra = extra.pop("kv_transfer_params", None) or {}
        body = super().build_request(
            rendered,
            model=model,
            trajectory_id=trajectory_id,
            branch=branch,
            max_tokens=max_tokens,
            temperature=temperature,
            extra=extra,
        )
        body["kv_transfer_params"] = {
            **kv_extra,
            "agentkv": {
                "trajectory_id": trajectory_id,
                "branch": branch,
                "zones": rendered.zones_param(),
                **({"pause_after": dict(pause_after)} if pause_after else {}),
            },
        }
        # vllm-router keys session affinity per source: the same hint on chat and control calls
        # (where it cannot read headers) sends both to the replica holding the trajectory.
        body.setdefault("agent_hint", {"session_id": trajectory_id})
        return body

    def parse_response(self, body: dict[str, Any]) -> ParsedTurn:
        parsed = super().parse_response(body)
        kv = body.get("kv_transfer_params")
        if isinstance(kv, dict) and isinstance(kv.get("agentkv"), dict):
            parsed.engine = dict(kv["agentkv"])
        return parsed


class AnthropicAdapter(Adapter):
    """Anthropic Messages API. The zones become ``cache_control`` breakpoints at their ends:
    tools (last tool), system (last system block), memory and recent (last block of the zone's
    last message); the observation is never cached. At most ``max_breakpoints`` (API limit 4),
    keeping the latest ones, which cover the longest prefix."""

    provider: ClassVar[str] = "anthropic"
    path: ClassVar[str] = "/v1/messages"
    MAX_BREAKPOINTS: ClassVar[int] = 4

    def __init__(
        self,
        *,
        version: str = "2023-06-01",
        default_max_tokens: int = 1024,
        ttl: str | None = None,
        max_breakpoints: int = 4,
    ) -> None:
        self.version = version
        self.default_max_tokens = default_max_tokens
        self.ttl = ttl
        self.max_breakpoints = max(0, min(max_breakpoints, self.MAX_BREAKPOINTS))

    def headers(self, api_key: str | None) -> dict[str, str]:
        h = {"anthropic-version": self.version}
        if api_key:
            h["x-api-key"] = api_key
        return h

    def _cc(self) -> dict[str, Any]:
        return {"type": "ephemeral", **({"ttl": self.ttl} if self.ttl else {})}

    @staticmethod
    def _tool(t: dict[str, Any]) -> dict[str, Any]:
        fn = t.get("function")
        if isinstance(fn, dict):  # OpenAI shape -> Anthropic shape
            return {
                "name": fn["name"],
                "description": fn.get("description", ""),
                "input_schema": fn.get("parameters") or {"type": "object", "properties": {}},
            }
        return dict(t)

    def build_request(
        self,
        rendered: RenderedContext,
        *,
        model: str,
        trajectory_id: str,
        branch: str,
        max_tokens: int | None,
        temperature: float | None,
        extra: dict[str, Any] | None,
        pause_after: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        marks: list[dict[str, Any]] = []  # blocks that end a zone, in prompt order
        tools = [self._tool(t) for t in rendered.tools]
        if tools:
            marks.append(tools[-1])
        system_blocks: list[dict[str, Any]] = []
        msgs: list[dict[str, Any]] = []
        zone_last: dict[str, dict[str, Any]] = {}
        for i, m in enumerate(rendered.messages):
            zone = rendered.zone_of_message(i) or "observation"
            blocks = (
                m["content"]
                if isinstance(m.get("content"), list)
                else [{"type": "text", "text": _text(m.get("content"))}]
            )
            blocks = [dict(b) for b in blocks]
            if not blocks:
                continue
            if m["role"] == "system":
                system_blocks.extend(blocks)
                zone_last["system"] = system_blocks[-1]
                continue
            role = "assistant" if m["role"] == "assistant" else "user"
            if msgs and msgs[-1]["role"] == role:
                msgs[-1]["content"].extend(blocks)
            else:
                msgs.append({"role": role, "content": blocks})
            zone_last[zone] = blocks[-1]
        for zone in ("system", "memory", "recent"):
            if zone in zone_last:
                marks.append(zone_last[zone])
        if self.max_breakpoints:
            for block in marks[-self.max_breakpoints :]:
                block["cache_control"] = self._cc()
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens or self.default_max_tokens,
            "messages": msgs,
        }
        if system_blocks:
            body["system"] = system_blocks
        if tools:
            body["tools"] = tools
        if temperature is not None:
            body["temperature"] = temperature
        body.update(extra or {})
        return body

    def parse_response(self, body: dict[str, Any]) -> ParsedTurn:
        content = _text(body.get("content"))
        usage = body.get("usage") or {}
        plain = _int(usage.get("input_tokens")) or 0
        read = _int(usage.get("cache_read_input_tokens"))
        created = _int(usage.get("cache_creation_input_tokens"))
        total = plain + (read or 0) + (created or 0) if usage else None
        cu = CacheUsage(
            input_tokens=total,
            output_tokens=_int(usage.get("output_tokens")),
            cached_tokens=read if read is not None else (0 if usage else None),
            cache_creation_tokens=created,
        )
        reasons = [str(body["stop_reason"])] if body.get("stop_reason") else []
        return ParsedTurn(
            {"role": "assistant", "content": content},
            content,
            cu,
            None,
            body.get("model"),
            body.get("id"),
            reasons,
        )
