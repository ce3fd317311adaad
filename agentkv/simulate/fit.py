"""Constrained least squares for engine costs: every cost non-negative, so every fitted cost
curve is monotone in tokens and context.

Primitives:
  nnls(rows, y) -> coefficients    least squares with every coefficient >= 0 (exact: the
                                   active-set answer found by trying every support, for the
                                   two to four columns these fits have)
  PrefillFit                       TTFT = a + n * linear + n * (c + n) * attention; notes
  fit_prefill(samples, base)       from (new tokens n, cached tokens c, seconds) samples; a term
                                   the data cannot carry falls back to ``base``'s, with a note
  DecodeFit                        step = overhead + per_seq * batch + attention * total context
  fit_decode(samples, base)        from (batch, total context tokens, seconds per step) samples

Why not plain least squares: on a run where queueing is part of every TTFT (a loaded engine, a
replay whose long-context rounds queued less than its short ones) the unconstrained attention
term comes out negative, i.e. longer contexts prefill faster; the simulator would then price a
recompute below a reload. A zero coefficient means "this data does not show the term": it is
then taken from the base calibration, and the note says so, never an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import combinations

from agentkv.simulate.costs import EngineCosts


def nnls(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """argmin ||A x - y|| subject to x >= 0 (A given by ``rows``), by trying every support."""
    import numpy as np

    a = np.asarray(rows, dtype=float)
    b = np.asarray(y, dtype=float)
    k = a.shape[1]
    # Scale columns so very different magnitudes (1 vs n * c) do not spoil the solves.
    scale = np.maximum(np.abs(a).max(axis=0), 1e-300)
    a = a / scale
    best: tuple[float, list[float]] = (float(np.sum(b * b)), [0.0] * k)
    for size in range(1, k + 1):
        for support in combinations(range(k), size):
            cols = list(support)
            sol, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(sol < 0):
                continue
            x = np.zeros(k)
            x[cols] = sol
            res = float(np.sum((a @ x - b) ** 2))
            if res < best[0] - 1e-15:
                best = (res, list(x))
    return [float(v / s) for v, s in zip(best[1], scale, strict=True)]


@dataclass(frozen=True)
class PrefillFit:
    intercept_s: float
    linear_s_per_token: float
    attention_s_per_pair: float
    notes: tuple[str, ...] = field(default_factory=tuple)


def fit_prefill(samples: Sequence[tuple[int, int, float]], base: EngineCosts) -> PrefillFit:
    """TTFT = a + n * linear + n (c + n) * attention over (n, c, seconds) samples, every term
    >= 0; a term fitted to 0 falls back to ``base``'s (the linear term then absorbs nothing
    more: the intercept and remaining term are refitted with the base's value held)."""
    rows = [[1.0, float(n), float(n) * (c + n)] for n, c, _ in samples]
    y = [s for _, _, s in samples]
    a, lin, attn = nnls(rows, y)
    notes: list[str] = []
    if lin <= 0 and attn <= 0:
        notes.append(
            "neither the linear nor the attention prefill cost is visible in these samples "
            f"(TTFT does not grow with tokens); kept {base.name}'s"
        )
        return PrefillFit(a, base.linear_s_per_token, base.attention_s_per_pair, tuple(notes))
    if attn <= 0:
        attn = base.attention_s_per_pair
        notes.append(
            "the attention cost fitted to 0 (TTFT did not grow with context: queueing or "
            f"noise); kept {base.name}'s attention rate and refitted the linear term"
        )
        rest = [s - attn * n * (c + n) for n, c, s in samples]
        a, lin = nnls([[1.0, float(n)] for n, _, _ in samples], rest)
    if lin <= 0:
        lin = base.linear_s_per_token
        notes.append(
            f"the linear cost fitted to 0; kept {base.name}'s linear rate and refitted attention"
        )
        rest = [s - lin * n for n, _, s in samples]
        a, attn2 = nnls([[1.0, float(n) * (c + n)] for n, c, _ in samples], rest)
        attn = attn2 if attn2 > 0 else base.attention_s_per_pair
    return PrefillFit(a, lin, attn, tuple(notes))


@dataclass(frozen=True)
class DecodeFit:
    overhead_s: float
    per_seq_s: float
    attention_s_per_token: float
    notes: tuple[str, ...] = field(default_factory=tuple)


def fit_decode(samples: Sequence[tuple[int, int, float]], base: EngineCosts) -> DecodeFit:
    """Step time = overhead + batch * per_seq + total_context * attention over (batch, total
    context tokens, seconds per step) samples, every term >= 0; no samples: ``base``'s."""
    if not samples:
        return DecodeFit(
            base.step_overhead_s,
            base.linear_s_per_token,
            base.attention_s_per_pair,
            ("no decode samples; kept the base's step cost",),
        )
    rows = [[1.0, float(b), float(ctx)] for b, ctx, _ in samples]
    over, per_seq, attn = nnls(rows, [s for _, _, s in samples])
    notes: list[str] = []
    if over <= 0:
        notes.append("the decode step overhead fitted to 0")
    return DecodeFit(over, per_seq, attn, tuple(notes))
