"""Constrained least squares for engine costs: every cost non-negative, so every fitted cost
curve is monotone in tokens and context.

Primitives:
  nnls(rows, y) -> coefficients    least squares with every coefficient >= 0 (exact: the
                                   active-set answer found by trying every support, for the
                                   two to four columns these fits have)
  PrefillFit                       TTFT = a + n * linear + n * (c + n) * attention; notes
  fit_prefill(samples, base)       from (new tokens n, cached tokens c, seconds) samples; a term
                                   the data cannot carry is derived from the other with ``base``'s ratio, a note
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
    >= 0. A term fitted to 0 is derived from the other with ``base``'s ratio of the two (the
    intercept refitted with both held); both 0: ``base``'s."""
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
    # One term fitted to 0: take the base's ratio of attention to linear cost (the model's
    # shape, not the machine's speed) and scale it by the term the data did show. Taking the
    # base's absolute rate mixed two machines: on the noisy profile of 2026-12-02 the base's
    # attention alone exceeded several measured TTFTs, the refitted linear term went to 0 and
    # both terms fell back to the base's, whatever the data said.
    ratio = base.attention_s_per_pair / base.linear_s_per_token
    if attn <= 0:
        attn = lin * ratio
        notes.append(
            "the attention cost fitted to 0 (TTFT did not grow with context: queueing or "
            f"noise); took {base.name}'s attention / linear ratio at the fitted linear rate"
        )
    elif lin <= 0:
        lin = attn / ratio
        notes.append(
            f"the linear cost fitted to 0; took {base.name}'s linear / attention ratio at the "
            "fitted attention rate"
        )
    else:
        return PrefillFit(a, lin, attn, tuple(notes))
    # The intercept refitted with both terms held (never below 0).
    rest = [s - n * lin - n * (c + n) * attn for n, c, s in samples]
    a = max(0.0, sum(rest) / len(rest))
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
