"""What a simulation measured, under the same names as the `agentkv bench agents` report.

Primitives:
  percentile(xs, q)     agentkv.stats.percentile (one definition for the bench and simulate)
  Recorder              per-turn and per-trajectory numbers kept as flat arrays (bounded: a few
                        numbers per turn), occupancy samples thinned to at most ``max_samples``
  Summary               one configuration's metrics: TTFT p50/p99 (all and resume turns), JCT,
                        tokens recomputed, hit rates, tier hits, makespan, demotions, evictions,
                        decisions, hit rate per turn index
  Recorder.summary(...) -> Summary
  COMPARED              the metrics checked against measured runs (docs/simulate.md)
"""

from __future__ import annotations

from array import array
from dataclasses import asdict, dataclass, field
from typing import Any

from agentkv.stats import percentile

COMPARED: tuple[str, ...] = (
    "resume_ttft_p50_s",
    "jct_mean_s",
    "prefix_hit_rate",
    "resume_hit_rate",
)


@dataclass
class Summary:
    name: str
    router: str
    replicas: int
    trajectories: int
    turns: int
    resume_turns: int
    rejected_turns: int
    resume_ttft_p50_s: float | None
    resume_ttft_p99_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    ttft_mean_s: float | None
    jct_mean_s: float | None
    jct_p50_s: float | None
    jct_max_s: float | None
    prompt_tokens: int
    cached_tokens: int
    recomputed_tokens: int
    resume_recomputed_tokens: int
    tier_hit_tokens: int
    prefix_hit_rate: float | None
    resume_hit_rate: float | None
    decode_tok_s: float | None
    output_tok_s: float | None
    makespan_s: float
    kv_usage_mean: float | None
    kv_usage_max: float | None
    demotions: int
    evicted_blocks: int
    tier_bytes_written: float
    tier_bytes_read: float
    engine_steps: int
    decisions: dict[str, int] = field(default_factory=dict)
    hit_rate_by_turn: dict[str, float] = field(default_factory=dict)
    engine_busy: float | None = None
    """Fraction of the run the replicas' engines were stepping (measured utilization)."""
    preemptions: int = 0
    """Running requests preempted for blocks (recompute), CHUNK admission only."""
    prefetch: dict[str, int] = field(default_factory=dict)
    """Device prefetch outcomes (on_time, late, wasted) and skips (skipped_<rule>)."""
    writebacks: dict[str, int] = field(default_factory=dict)
    """Deferred host write-backs (``Writeback.FORECAST``): deferred, copied, lost (evicted
    before the copy), lost_blocks."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Recorder:
    """Accumulates one run's numbers."""

    def __init__(self, max_samples: int = 2000) -> None:
        self.ttft = array("d")
        self.resume_ttft = array("d")
        self.prompt = 0
        self.cached = 0
        self.resume_prompt = 0
        self.resume_cached = 0
        self.tier_hits = 0
        self.rejected = 0
        self.decode_tokens = 0
        self.decode_s = 0.0
        self.output_tokens = 0
        self.jct = array("d")
        self.by_turn: dict[int, list[int]] = {}
        self.max_samples = max_samples
        self.samples: list[tuple[float, ...]] = []
        self.sample_every = 1

    def turn(
        self,
        index: int,
        resume: bool,
        ttft: float,
        latency: float,
        prompt: int,
        cached: int,
        tier: int,
        output: int,
    ) -> None:
        self.ttft.append(ttft)
        self.output_tokens += output
        self.decode_tokens += max(0, output - 1)
        self.decode_s += max(0.0, latency - ttft)
        self.prompt += prompt
        self.cached += cached
        self.tier_hits += tier
        if resume:
            self.resume_ttft.append(ttft)
            self.resume_prompt += prompt
            self.resume_cached += cached
        row = self.by_turn.setdefault(index, [0, 0])
        row[0] += cached
        row[1] += prompt

    def sample(self, values: tuple[float, ...]) -> None:
        """One occupancy sample: (t, device used frac, pinned frac, host B, disk B, remote B,
        paused trajectories). Keeps every ``sample_every``-th; halves the series when full."""
        self.samples.append(values)
        if len(self.samples) >= self.max_samples:
            self.samples = self.samples[::2]
            self.sample_every *= 2

    def summary(
        self,
        name: str,
        router: str,
        replicas: int,
        makespan_s: float,
        demotions: int,
        evicted_blocks: int,
        tier_written: float,
        tier_read: float,
        steps: int,
        decisions: dict[str, int],
        engine_busy: float | None = None,
        preemptions: int = 0,
    ) -> Summary:
        usage = [s[1] for s in self.samples]
        return Summary(
            name=name,
            router=router,
            replicas=replicas,
            trajectories=len(self.jct),
            turns=len(self.ttft),
            resume_turns=len(self.resume_ttft),
            rejected_turns=self.rejected,
            resume_ttft_p50_s=percentile(self.resume_ttft, 50),
            resume_ttft_p99_s=percentile(self.resume_ttft, 99),
            ttft_p50_s=percentile(self.ttft, 50),
            ttft_p99_s=percentile(self.ttft, 99),
            ttft_mean_s=sum(self.ttft) / len(self.ttft) if self.ttft else None,
            jct_mean_s=sum(self.jct) / len(self.jct) if self.jct else None,
            jct_p50_s=percentile(self.jct, 50),
            jct_max_s=max(self.jct) if self.jct else None,
            prompt_tokens=self.prompt,
            cached_tokens=self.cached,
            recomputed_tokens=self.prompt - self.cached,
            resume_recomputed_tokens=self.resume_prompt - self.resume_cached,
            tier_hit_tokens=self.tier_hits,
            prefix_hit_rate=self.cached / self.prompt if self.prompt else None,
            resume_hit_rate=self.resume_cached / self.resume_prompt if self.resume_prompt else None,
            decode_tok_s=self.decode_tokens / self.decode_s if self.decode_s > 0 else None,
            output_tok_s=self.output_tokens / makespan_s if makespan_s > 0 else None,
            makespan_s=makespan_s,
            kv_usage_mean=sum(usage) / len(usage) if usage else None,
            kv_usage_max=max(usage) if usage else None,
            demotions=demotions,
            evicted_blocks=evicted_blocks,
            tier_bytes_written=tier_written,
            tier_bytes_read=tier_read,
            engine_steps=steps,
            decisions=dict(sorted(decisions.items())),
            hit_rate_by_turn={str(k): v[0] / max(1, v[1]) for k, v in sorted(self.by_turn.items())},
            engine_busy=engine_busy,
            preemptions=preemptions,
        )
