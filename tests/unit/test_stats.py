"""agentkv.stats: the summary statistics every report shares."""

from __future__ import annotations

from agentkv.stats import mean, percentile, ratios


def test_percentile_interpolates_like_numpy_and_is_none_without_data() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert abs((percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) or 0.0) - 4.6) < 1e-12
    assert mean([]) is None and mean([1.0, 2.0]) == 1.5


def test_ratios_divide_only_numbers_over_a_nonzero_base() -> None:
    a = {"ttft": 1.0, "jct": 6.0, "hits": None, "name": "agentkv", "zero": 3.0}
    b = {"ttft": 2.0, "jct": 3.0, "hits": 4.0, "name": "vanilla", "zero": 0.0}
    got = ratios(a, b, ["ttft", "jct", "hits", "name", "zero", "absent"])
    assert got == {
        "ttft": 0.5, "jct": 2.0, "hits": None, "name": None, "zero": None, "absent": None
    }  # fmt: skip
