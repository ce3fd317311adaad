"""OpenTelemetry for harness_sdk: names, the per-turn span, the tool-wait span and the metrics.

Primitives:
  Telemetry(tracer_provider?, meter_provider?)   tracer + instruments; globals when not given
  Telemetry.turn_span(...)                       context manager: one CLIENT span per turn
  Telemetry.record_turn(span, ...)               GenAI semconv + ``agentkv.*`` attributes, metrics
  Telemetry.tool_span(...)                       context manager: one INTERNAL span per tool wait
  Telemetry.record_tool_wait(...)                tool-wait duration histogram
  attribute / metric name constants              ATTR_*, METRIC_*

Only ``opentelemetry-api`` is imported. Without a configured SDK the API hands out no-op
tracers and meters, so everything here costs next to nothing and never fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

INSTRUMENTATION = "harness_sdk"

ATTR_OPERATION = "gen_ai.operation.name"
ATTR_PROVIDER = "gen_ai.provider.name"
ATTR_SYSTEM = "gen_ai.system"
ATTR_REQUEST_MODEL = "gen_ai.request.model"
ATTR_RESPONSE_MODEL = "gen_ai.response.model"
ATTR_RESPONSE_ID = "gen_ai.response.id"
ATTR_FINISH_REASONS = "gen_ai.response.finish_reasons"
ATTR_MAX_TOKENS = "gen_ai.request.max_tokens"
ATTR_TEMPERATURE = "gen_ai.request.temperature"
ATTR_INPUT_TOKENS = "gen_ai.usage.input_tokens"
ATTR_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
ATTR_CACHE_READ = "gen_ai.usage.cache_read.input_tokens"
ATTR_CACHE_CREATION = "gen_ai.usage.cache_creation.input_tokens"
ATTR_CONVERSATION = "gen_ai.conversation.id"
ATTR_SERVER_ADDRESS = "server.address"
ATTR_SERVER_PORT = "server.port"

ATTR_BRANCH = "agentkv.branch"
ATTR_TURN = "agentkv.turn"
ATTR_HIT_RATIO = "agentkv.prefix_hit_ratio"
ATTR_FIRST_DIVERGENCE = "agentkv.first_divergence_token"
ATTR_DIVERGENCE_ZONE = "agentkv.divergence_zone"
ATTR_TIER = "agentkv.tier"
ATTR_TIER_HIT = "agentkv.tier_hit_tokens"
ATTR_ZONE_CHANGED = "agentkv.zone_changed"
ATTR_LINT = "agentkv.lint.volatile"
ATTR_CLIENT_DIVERGENCE_MSG = "agentkv.client_divergence_message"
ATTR_TOOL = "agentkv.tool.name"
ATTR_TOOL_EXPECTED = "agentkv.tool.expected_s"
ATTR_TOOL_DURATION = "agentkv.tool.duration_s"
ATTR_PAUSE_ACTION = "agentkv.pause.action"
ATTR_PAUSE_APPLIED = "agentkv.pause.applied"

METRIC_HIT_RATIO = "agentkv.sdk.prefix_hit_ratio"
METRIC_TOOL_WAIT = "agentkv.sdk.tool_wait.duration"
METRIC_TOKEN_USAGE = "gen_ai.client.token.usage"

EVENT_ZONE_CHANGED = "agentkv.zone_changed"


def _clean(attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attrs.items() if v is not None}


class Telemetry:
    """Tracer and instruments of one SDK user; providers default to the global ones."""

    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
    ) -> None:
        from harness_sdk import __version__

        self.tracer = trace.get_tracer(
            INSTRUMENTATION, __version__, tracer_provider=tracer_provider
        )
        meter = metrics.get_meter(INSTRUMENTATION, __version__, meter_provider=meter_provider)
        self.hit_ratio = meter.create_histogram(
            METRIC_HIT_RATIO,
            unit="1",
            description="Prefix-cache hit ratio of each turn, per trajectory",
        )
        self.tool_wait = meter.create_histogram(
            METRIC_TOOL_WAIT, unit="s", description="Measured tool-wait durations"
        )
        self.token_usage = meter.create_histogram(
            METRIC_TOKEN_USAGE, unit="{token}", description="GenAI client token usage"
        )

    @contextlib.contextmanager
    def turn_span(
        self,
        *,
        model: str,
        provider: str,
        trajectory_id: str,
        branch: str,
        turn: int,
        max_tokens: int | None,
        temperature: float | None,
        server: tuple[str, int | None],
    ) -> Iterator[Span]:
        attrs = _clean(
            {
                ATTR_OPERATION: "chat",
                ATTR_REQUEST_MODEL: model,
                ATTR_PROVIDER: provider,
                ATTR_SYSTEM: provider,
                ATTR_CONVERSATION: trajectory_id,
                ATTR_BRANCH: branch,
                ATTR_TURN: turn,
                ATTR_MAX_TOKENS: max_tokens,
                ATTR_TEMPERATURE: temperature,
                ATTR_SERVER_ADDRESS: server[0] or None,
                ATTR_SERVER_PORT: server[1],
            }
        )
        with self.tracer.start_as_current_span(
            f"chat {model}",
            kind=SpanKind.CLIENT,
            attributes=attrs,
            record_exception=True,
            set_status_on_exception=True,
        ) as span:
            yield span

    def record_turn(
        self,
        span: Span,
        *,
        model: str,
        provider: str,
        trajectory_id: str,
        branch: str,
        input_tokens: int | None,
        output_tokens: int | None,
        cached_tokens: int | None,
        cache_creation_tokens: int | None,
        hit_ratio: float | None,
        engine: dict[str, Any] | None,
        response_model: str | None,
        response_id: str | None,
        finish_reasons: Sequence[str],
        zone_changes: Sequence[tuple[str, str]],
        lint: Sequence[str],
        client_divergence_message: int | None,
    ) -> None:
        engine = engine or {}
        span.set_attributes(
            _clean(
                {
                    ATTR_INPUT_TOKENS: input_tokens,
                    ATTR_OUTPUT_TOKENS: output_tokens,
                    ATTR_CACHE_READ: cached_tokens,
                    ATTR_CACHE_CREATION: cache_creation_tokens,
                    ATTR_HIT_RATIO: hit_ratio,
                    ATTR_FIRST_DIVERGENCE: engine.get("first_divergence_token"),
                    ATTR_DIVERGENCE_ZONE: engine.get("divergence_zone"),
                    ATTR_TIER: engine.get("tier"),
                    ATTR_TIER_HIT: engine.get("tier_hit_tokens"),
                    ATTR_RESPONSE_MODEL: response_model,
                    ATTR_RESPONSE_ID: response_id,
                    ATTR_FINISH_REASONS: list(finish_reasons) or None,
                    ATTR_ZONE_CHANGED: [z for z, _ in zone_changes] or None,
                    ATTR_LINT: list(lint) or None,
                    ATTR_CLIENT_DIVERGENCE_MSG: client_divergence_message,
                }
            )
        )
        for zone, diff in zone_changes:
            span.add_event(EVENT_ZONE_CHANGED, {"agentkv.zone": zone, "agentkv.diff": diff[:4000]})
        metric_attrs = {
            ATTR_CONVERSATION: trajectory_id,
            ATTR_BRANCH: branch,
            ATTR_REQUEST_MODEL: model,
            ATTR_PROVIDER: provider,
        }
        if hit_ratio is not None:
            self.hit_ratio.record(hit_ratio, metric_attrs)
        base = {ATTR_OPERATION: "chat", ATTR_REQUEST_MODEL: model, ATTR_PROVIDER: provider}
        if input_tokens is not None:
            self.token_usage.record(input_tokens, {**base, "gen_ai.token.type": "input"})
        if output_tokens is not None:
            self.token_usage.record(output_tokens, {**base, "gen_ai.token.type": "output"})

    @contextlib.contextmanager
    def tool_span(
        self, *, tool: str, expected_s: float | None, trajectory_id: str, branch: str
    ) -> Iterator[Span]:
        attrs = _clean(
            {
                ATTR_TOOL: tool,
                ATTR_TOOL_EXPECTED: expected_s,
                ATTR_CONVERSATION: trajectory_id,
                ATTR_BRANCH: branch,
                ATTR_OPERATION: "execute_tool",
                "gen_ai.tool.name": tool,
            }
        )
        with self.tracer.start_as_current_span(
            f"tool_wait {tool}",
            kind=SpanKind.INTERNAL,
            attributes=attrs,
            record_exception=True,
            set_status_on_exception=True,
        ) as span:
            yield span

    def record_tool_wait(
        self, span: Span, *, tool: str, duration_s: float, error: BaseException | None
    ) -> None:
        span.set_attribute(ATTR_TOOL_DURATION, duration_s)
        attrs: dict[str, Any] = {ATTR_TOOL: tool}
        if error is not None:
            attrs["error.type"] = type(error).__name__
            span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
        self.tool_wait.record(duration_s, attrs)
