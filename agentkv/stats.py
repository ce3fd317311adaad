"""Summary statistics shared by the bench, the trace replay and ``agentkv simulate``.

Primitives:
    percentile(xs, q)   the q-th percentile (0-100), linear interpolation between order
                        statistics (numpy's default); None for no data
    mean(xs)            the arithmetic mean; None for no data
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None
