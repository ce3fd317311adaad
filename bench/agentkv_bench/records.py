"""One record type for every measured request: a bench turn and a trace round alike.

Primitives:
  RequestRecord   what every measured request carries: trajectory, kind (first | resume), send
                  time, TTFT, latency, token counts, agentkv's pause decision and the hits it
                  reported; ``recomputed_tokens`` and ``to_dict`` (JSON-ready)
  TurnRecord      a bench workload's turn: branch, turn index, tool, the wait before it
  RoundRecord     a replayed trace's round: session, round index, the wait before it, the prefix
                  the session's history planned and how much of it any cache could hold

The reports (report.py, trace_report.py) read only ``RequestRecord`` fields for TTFT, hits and
recompute, so both kinds of runs are summarised by the same definitions (agentkv.stats).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(kw_only=True)
class RequestRecord:
    trajectory_id: str
    kind: str  # "first" (no wait before it) or "resume" (the first request after a wait)
    sent_at_s: float  # since the run started
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    decision: str | None = None  # agentkv's pause decision before this request
    device_hit_tokens: int | None = None
    tier_hit_tokens: int | None = None
    tier: str | None = None
    prefetch: str | None = None  # agentkv's device prefetch of the pause before it
    # The pause decision's write-back numbers (trace replay): the copy waits for the pool's
    # eviction forecast only when that comes after the wait's p90 plus a margin.
    writeback_deferred: bool | None = None
    eviction_in_s: float | None = None
    wait_p90_s: float | None = None
    # Wall time of the agentkv control calls around the wait before it (pause + resume): the
    # agent waits for each, so it is on the job's critical path. None: no agentkv calls.
    control_s: float | None = None

    @property
    def recomputed_tokens(self) -> int:
        """Prompt tokens the engine had to prefill: neither in its cache nor loaded from a tier."""
        return max(0, self.prompt_tokens - self.cached_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "recomputed_tokens": self.recomputed_tokens}


@dataclass(kw_only=True)
class TurnRecord(RequestRecord):
    branch: str
    turn: int
    tool: str | None
    wait_s: float


@dataclass(kw_only=True)
class RoundRecord(RequestRecord):
    session_id: str
    round: int  # 0-based, as round_idx in the trace
    wait_before_s: float
    planned_prefix: int  # prompt tokens taken from the session's history
    reusable_tokens: int  # of those, the ones any cache could hold: the previous prompt's part
