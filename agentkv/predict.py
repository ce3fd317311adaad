"""How long a paused trajectory will wait, when to start its reload, and how that went.

Primitives:
    WaitEstimate            p10 / p50 / p90 of one pause's wait in seconds, and where they came from
    DEFAULT_PRIOR           the cold-start estimate for a tool nobody has seen nor declared
    WaitPredictor           per-tool online quantiles (a DDSketch each) seeded by the harness's
                            declared ``expected_wait_s`` and the prior; ``predict`` / ``observe``
    prefetch_at             when to start reloading: p10 - reload - margin, never before the pause
    PrefetchOutcome         'early' | 'on_time' | 'late' | 'wasted'
    classify_prefetch       label one prefetch from when it finished and when the trajectory resumed
    PrefetchOutcomeCounter  thread-safe tally of outcomes, for /status and metrics

Waits are heavy-tailed (a test run, a web fetch, a person approving), so quantiles are kept in a
DDSketch, whose error is relative to the value (1% by default) at any scale, from milliseconds to
hours. The seed (a declared wait, else the prior) counts as ``seed_weight`` pseudo-samples and is
blended with the observed quantiles in log space, so a handful of observations move the estimate
and a few hundred make the seed negligible. Nothing here raises on bad numbers: NaN, negative or
infinite inputs are ignored (observations) or replaced by the prior (declared waits), because the
engine's hot path calls this code.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ddsketch import DDSketch

PrefetchOutcome = Literal["early", "on_time", "late", "wasted"]
PREFETCH_OUTCOMES: tuple[PrefetchOutcome, ...] = ("early", "on_time", "late", "wasted")

WaitSource = Literal["prior", "declared", "observed"]


@dataclass(frozen=True)
class WaitEstimate:
    """Quantiles of one pause's wait, in seconds (p10 <= p50 <= p90)."""

    p10: float
    p50: float
    p90: float
    source: WaitSource
    """'prior' (nothing known), 'declared' (the harness's expected_wait_s), 'observed' (sketch)."""
    samples: int = 0
    """Observed durations of this tool behind the estimate."""

    @classmethod
    def point(cls, wait_s: float, source: WaitSource = "declared") -> WaitEstimate:
        """An estimate with all three quantiles at ``wait_s`` (a single declared or assumed wait)."""
        return cls(p10=wait_s, p50=wait_s, p90=wait_s, source=source)

    def is_valid(self) -> bool:
        """True when every quantile is a non-negative number (inf allowed) and they are ordered."""
        values = (self.p10, self.p50, self.p90)
        if any(math.isnan(v) or v < 0 for v in values):
            return False
        return self.p10 <= self.p50 <= self.p90

    def to_dict(self) -> dict[str, float | int | str | None]:
        """JSON-ready mapping; an infinite quantile becomes None."""
        return {
            "p10": _finite_or_none(self.p10),
            "p50": _finite_or_none(self.p50),
            "p90": _finite_or_none(self.p90),
            "source": self.source,
            "samples": self.samples,
        }


# A tool nobody declared nor observed: most agent tools (file reads, greps, short builds) return
# in seconds, but the tail (test suites, people) runs to minutes.
DEFAULT_PRIOR = WaitEstimate(p10=0.5, p50=5.0, p90=60.0, source="prior")

# Spread put around a declared wait: a harness's guess is a median, not a bound.
_DECLARED_LOW = 0.5
_DECLARED_HIGH = 2.0
_QUANTILES = (0.1, 0.5, 0.9)
# Declared waits above this (about 30 years) are clamped so that the spread stays finite.
_MAX_DECLARED_S = 1e9
# Log-space blending needs a positive floor; a microsecond is below anything worth modelling.
_TINY_S = 1e-6


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _usable_seconds(value: float | None) -> bool:
    return value is not None and not math.isnan(value) and math.isfinite(value) and value >= 0


def _log_blend(observed: float, seed: float, weight_observed: float) -> float:
    a = math.log(max(observed, _TINY_S))
    b = math.log(max(seed, _TINY_S))
    return math.exp(weight_observed * a + (1.0 - weight_observed) * b)


class WaitPredictor:
    """Per-tool wait quantiles learned online; safe to share between threads.

    ``predict(tool, declared_s)`` answers from what was observed for ``tool``, blended with the
    seed (``declared_s`` when it is a usable number, else ``prior``); ``observe(tool, duration_s)``
    adds one measured wait. At most ``max_tools`` tool names are remembered (least recently
    observed forgotten first), because tool names come from clients.
    """

    def __init__(
        self,
        *,
        prior: WaitEstimate = DEFAULT_PRIOR,
        seed_weight: float = 5.0,
        prior_weight: float = 0.25,
        relative_accuracy: float = 0.01,
        max_tools: int = 4096,
    ) -> None:
        if not prior.is_valid() or math.isinf(prior.p90):
            raise ValueError(f"prior must hold finite, ordered, non-negative quantiles: {prior}")
        if not seed_weight >= 0:
            raise ValueError(f"seed_weight must be >= 0, got {seed_weight}")
        if max_tools < 1:
            raise ValueError(f"max_tools must be >= 1, got {max_tools}")
        self.prior = prior
        self.seed_weight = seed_weight
        self.prior_weight = prior_weight
        self.relative_accuracy = relative_accuracy
        self.max_tools = max_tools
        self._sketches: OrderedDict[str, DDSketch] = OrderedDict()
        self._lock = threading.Lock()

    def _seed(self, declared_s: float | None) -> WaitEstimate:
        if declared_s is not None and _usable_seconds(declared_s):
            declared_s = min(declared_s, _MAX_DECLARED_S)
            return WaitEstimate(
                p10=declared_s * _DECLARED_LOW,
                p50=declared_s,
                p90=declared_s * _DECLARED_HIGH,
                source="declared",
            )
        return self.prior

    def predict(self, tool: str, declared_s: float | None = None) -> WaitEstimate:
        """Estimate the wait of a pause on ``tool``.

        Contract: never raises; returns ordered, finite, non-negative quantiles. With no
        observations of ``tool`` the seed is returned as is (source 'declared' or 'prior'); with n
        observations each quantile is exp(w*log(observed) + (1-w)*log(seed)), w = n/(n+seed_weight),
        source 'observed'. A NaN, negative or infinite ``declared_s`` is ignored.
        """
        seed = self._seed(declared_s)
        with self._lock:
            sketch = self._sketches.get(tool)
            if sketch is None or sketch.count <= 0:
                return seed
            samples = int(sketch.count)
            observed = [sketch.get_quantile_value(q) for q in _QUANTILES]
        pseudo = self.seed_weight if seed.source == "declared" else self.prior_weight
        weight = samples / (samples + pseudo)
        seed_values = (seed.p10, seed.p50, seed.p90)
        blended = [
            _log_blend(obs if obs is not None else s, s, weight)
            for obs, s in zip(observed, seed_values, strict=True)
        ]
        # Blending each quantile separately keeps them ordered (both inputs are), but clamp
        # against rounding so p10 <= p50 <= p90 holds exactly.
        p10 = min(blended[0], blended[1])
        p90 = max(blended[2], blended[1])
        return WaitEstimate(p10=p10, p50=blended[1], p90=p90, source="observed", samples=samples)

    def observe(self, tool: str, duration_s: float) -> bool:
        """Record one measured wait of ``tool``.

        Contract: never raises; returns False (and records nothing) when ``duration_s`` is NaN,
        negative or infinite, True otherwise.
        """
        if not _usable_seconds(duration_s):
            return False
        with self._lock:
            sketch = self._sketches.get(tool)
            if sketch is None:
                sketch = DDSketch(relative_accuracy=self.relative_accuracy)
                self._sketches[tool] = sketch
                while len(self._sketches) > self.max_tools:
                    self._sketches.popitem(last=False)
            else:
                self._sketches.move_to_end(tool)
            sketch.add(max(duration_s, _TINY_S))
        return True

    def longest(self, tools: Sequence[str], declared_s: float | None = None) -> str:
        """The tool of ``tools`` whose predicted p50 wait is the longest (the first on a tie).

        The rule for parallel tool calls: the harness resumes when the slowest call returns, so
        the pause is predicted, and its observed wait learned, as that tool's. ``tools`` must
        not be empty."""
        if not tools:
            raise ValueError("longest() needs at least one tool")
        best, best_p50 = tools[0], -1.0
        for tool in dict.fromkeys(tools):
            p50 = self.predict(tool, declared_s).p50
            if p50 > best_p50:
                best, best_p50 = tool, p50
        return best

    def tools(self) -> dict[str, int]:
        """Observed sample count per remembered tool name."""
        with self._lock:
            return {name: int(s.count) for name, s in self._sketches.items()}


def prefetch_at(estimate: WaitEstimate, reload_s: float, margin_s: float = 0.05) -> float:
    """Seconds after the pause at which to start reloading the trajectory's KV.

    Contract: returns max(0, p10 - reload_s - margin_s): the reload is then done before the tool
    returns in about 90% of pauses. Never raises; a NaN or negative input gives 0.0 (reload at
    once, which is never late, only possibly early).
    """
    value = estimate.p10 - reload_s - margin_s
    if math.isnan(value) or value <= 0:
        return 0.0
    return value


def classify_prefetch(
    prefetch_done_at: float | None,
    resumed_at: float | None,
    *,
    early_slack_s: float = 1.0,
    late_tolerance_s: float = 0.0,
    evicted_before_resume: bool = False,
) -> PrefetchOutcome:
    """Label one prefetch; times are on one monotonic clock, in seconds.

    Contract (never raises; NaN times count as missing):
      - 'wasted'  the trajectory never resumed (``resumed_at`` None: ended or abandoned), or the
                  prefetched blocks were evicted before it did;
      - 'late'    it resumed before the prefetch finished (by more than ``late_tolerance_s``), or the
                  prefetch never finished: the resume waited on its own reload;
      - 'early'   the prefetch finished more than ``early_slack_s`` before the resume: device
                  memory was held for nothing in between;
      - 'on_time' otherwise.
    """
    done = None if prefetch_done_at is None or math.isnan(prefetch_done_at) else prefetch_done_at
    resumed = None if resumed_at is None or math.isnan(resumed_at) else resumed_at
    if resumed is None or evicted_before_resume:
        return "wasted"
    if done is None:
        return "late"
    ahead = resumed - done
    if ahead < -late_tolerance_s:
        return "late"
    if ahead > early_slack_s:
        return "early"
    return "on_time"


class PrefetchOutcomeCounter:
    """Thread-safe tally of prefetch outcomes."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def record(self, outcome: PrefetchOutcome) -> None:
        """Count one outcome. Contract: ignores labels outside PREFETCH_OUTCOMES, never raises."""
        if outcome not in PREFETCH_OUTCOMES:
            return
        with self._lock:
            self._counts[outcome] += 1

    def counts(self) -> dict[str, int]:
        """A snapshot with every outcome present (zeros included)."""
        with self._lock:
            return {name: self._counts[name] for name in PREFETCH_OUTCOMES}

    def total(self) -> int:
        """How many outcomes were recorded."""
        with self._lock:
            return sum(self._counts.values())
