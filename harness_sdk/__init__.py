"""harness_sdk: the client SDK agent frameworks import to keep an agent's KV cache warm.

Primitives:
  Trajectory / SyncTrajectory   zoned turns, ``tool()`` waits, ``fork()``/``prune()``/``join()``,
                                ``close()``; async first, with a blocking twin
  TurnResult, ToolWait          a turn's reply and cache stats; a tool wait's decision and duration
  Context, ZONES, canonical_json, freeze_tools, lint_volatile, ZoneChange    the zone layout
  AgentKVAdapter, OpenAIAdapter, AnthropicAdapter, CacheUsage               provider adapters
  Telemetry                     OTel spans and metrics (no-op unless an SDK is configured)
  HarnessError and its tree     see ``harness_sdk.errors``
  harness_sdk.openai.wrap       the official ``openai`` client (sync or async) bound to a
                                trajectory: session id + params on every call (chat, completions,
                                responses), ``tool()`` waits
  harness_sdk.anthropic.wrap    the same for the official ``anthropic`` client (``messages``)

Trajectory ids and branch names follow ``agentkv.ids`` (checked before any request is sent).
Never imports vllm. Talks to any OpenAI-compatible server over httpx and uses the agentkv
routes (pause/resume/close) only when the server has them.
"""

from __future__ import annotations

__version__ = "0.1.0"

from harness_sdk.adapters import (
    Adapter,
    AgentKVAdapter,
    AnthropicAdapter,
    CacheUsage,
    OpenAIAdapter,
    ParsedTurn,
)
from harness_sdk.errors import (
    AuthenticationError,
    BadRequestError,
    ConfigError,
    DegradedWarning,
    HarnessError,
    HarnessWarning,
    HTTPStatusError,
    InvalidIdError,
    LayoutError,
    NotFoundError,
    PauseNotAppliedWarning,
    RateLimitError,
    ServerError,
    StableZoneChangedWarning,
    TimeoutError_,
    TrajectoryClosedError,
    TrajectoryNotFoundWarning,
    TransportError,
    VolatileContentWarning,
)
from harness_sdk.telemetry import Telemetry
from harness_sdk.trajectory import SyncTrajectory, ToolWait, Trajectory, TurnResult
from harness_sdk.zones import (
    STABLE_ZONES,
    ZONES,
    Context,
    LintFinding,
    RenderedContext,
    ZoneChange,
    canonical_json,
    freeze_tools,
    lint_volatile,
)

__all__ = [
    "STABLE_ZONES",
    "ZONES",
    "Adapter",
    "AgentKVAdapter",
    "AnthropicAdapter",
    "AuthenticationError",
    "BadRequestError",
    "CacheUsage",
    "ConfigError",
    "Context",
    "DegradedWarning",
    "HTTPStatusError",
    "HarnessError",
    "HarnessWarning",
    "InvalidIdError",
    "LayoutError",
    "LintFinding",
    "NotFoundError",
    "OpenAIAdapter",
    "ParsedTurn",
    "PauseNotAppliedWarning",
    "RateLimitError",
    "RenderedContext",
    "ServerError",
    "StableZoneChangedWarning",
    "SyncTrajectory",
    "Telemetry",
    "TimeoutError_",
    "ToolWait",
    "Trajectory",
    "TrajectoryClosedError",
    "TrajectoryNotFoundWarning",
    "TransportError",
    "TurnResult",
    "VolatileContentWarning",
    "ZoneChange",
    "canonical_json",
    "freeze_tools",
    "lint_volatile",
]
