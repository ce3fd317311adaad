"""Repeats of a sweep's pool size: the ABBA order, the median over repeats and the merge."""

from __future__ import annotations

import pytest

from agentkv_bench.repeats import median, merge, repeat_label, run_order, validate_repeats

CONFIGS = ("vanilla", "agentkv", "retain-always", "offload-always")


def test_run_order_alternates_given_and_reversed() -> None:
    assert [run_order(CONFIGS, k) for k in range(4)] == [
        CONFIGS,
        ("offload-always", "retain-always", "agentkv", "vanilla"),
        CONFIGS,
        ("offload-always", "retain-always", "agentkv", "vanilla"),
    ]
    # in each pair of repeats every configuration runs once in each position: an order effect
    # charges them alike
    pos = {c: run_order(CONFIGS, 0).index(c) + run_order(CONFIGS, 1).index(c) for c in CONFIGS}
    assert set(pos.values()) == {len(CONFIGS) - 1}
    with pytest.raises(ValueError):
        run_order(CONFIGS, -1)


def test_repeat_label_counts_from_one_and_keeps_the_plain_label_without_repeats() -> None:
    assert repeat_label(48, 1, 3) == "[pool 48, repeat 2/3] "
    assert repeat_label(48, 0, 1) == "[48 blocks] "


@pytest.mark.parametrize("bad", [0, -2, True, 1.5])
def test_validate_repeats_refuses_anything_but_a_positive_integer(bad: object) -> None:
    with pytest.raises(ValueError, match="--repeats must be an integer >= 1"):
        validate_repeats(bad)  # type: ignore[arg-type]
    assert validate_repeats(3) == 3


def test_median_odd_even_and_missing_values() -> None:
    assert median([0.3, 0.1, 0.2]) == pytest.approx(0.2)  # odd: the middle one, not the mean
    assert median([0.1, 0.9, 0.2, 0.3]) == pytest.approx(0.25)  # even: mean of the middle two
    assert median([None, 0.1, 0.5]) == pytest.approx(0.3)  # None skipped, not a zero
    assert median([None, None]) is None
    assert median([]) is None
    assert median([True, 4]) == 4  # a flag is not a measurement


def test_merge_keeps_raw_values_and_medians_per_configuration() -> None:
    reps = [
        {
            "vanilla": {"ttft": 0.10, "decode": 80.0},
            "agentkv": {"ttft": 0.20, "wb": 5, "decisions": {"offload_host": 3}},
        },
        {
            "vanilla": {"ttft": 0.40, "decode": None},
            "agentkv": {"ttft": 0.12, "decisions": {"offload_host": 2, "retain": 1}},
        },
        {
            "vanilla": {"ttft": 0.12},  # decode missing in this repeat
            "agentkv": {"ttft": 0.14, "wb": 9},
            "retain-always": {"ttft": 0.5},  # only in one repeat
        },
    ]
    m = merge(reps, ["ttft", "decode", "wb"])
    assert list(m.medians) == ["vanilla", "agentkv", "retain-always"]
    assert m.values["vanilla"] == {
        "ttft": [0.10, 0.40, 0.12],
        "decode": [80.0, None, None],
        "wb": [None, None, None],
    }
    assert m.medians["vanilla"]["ttft"] == pytest.approx(0.12)
    assert m.medians["vanilla"]["decode"] == pytest.approx(80.0)
    assert m.medians["vanilla"]["wb"] is None
    assert m.medians["agentkv"]["ttft"] == pytest.approx(0.14)
    assert m.medians["agentkv"]["wb"] == pytest.approx(7.0)  # even count among the present
    assert m.medians["agentkv"]["decisions"] == {"offload_host": 5, "retain": 1}
    assert m.values["retain-always"]["ttft"] == [None, None, 0.5]
    assert m.medians["retain-always"]["ttft"] == pytest.approx(0.5)
    with pytest.raises(ValueError):
        merge([], ["ttft"])
