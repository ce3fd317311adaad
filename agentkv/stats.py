"""Summary statistics shared by the bench, the trace replay and ``agentkv simulate``.

Primitives:
    percentile(xs, q)   the q-th percentile (0-100), linear interpolation between order
                        statistics (numpy's default); None for no data
    mean(xs)            the arithmetic mean; None for no data
    ratios(a, b, keys)  ``a[k] / b[k]`` per key; None where either is missing or not a number,
                        or ``b[k]`` is 0 (the agentkv/vanilla tables of both bench reports)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


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


def ratios(
    a: Mapping[str, Any], b: Mapping[str, Any], keys: Iterable[str]
) -> dict[str, float | None]:
    """``a[k] / b[k]`` for each of ``keys``; None where either side is missing or not a number,
    or ``b[k]`` is 0."""
    out: dict[str, float | None] = {}
    for key in keys:
        x, y = a.get(key), b.get(key)
        out[key] = (
            x / y if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y else None
        )
    return out
