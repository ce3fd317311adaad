"""Wait prediction, prefetch timing and prefetch outcome classification."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.predict import (
    DEFAULT_PRIOR,
    PrefetchOutcomeCounter,
    WaitEstimate,
    WaitPredictor,
    classify_prefetch,
    prefetch_at,
)


def test_unknown_tool_gets_the_prior() -> None:
    est = WaitPredictor().predict("never-seen", None)
    assert est == DEFAULT_PRIOR
    assert est.source == "prior"


def test_declared_wait_seeds_the_estimate() -> None:
    est = WaitPredictor().predict("pytest", 45.0)
    assert est.source == "declared"
    assert est.p50 == 45.0
    assert est.p10 < 45.0 < est.p90


@pytest.mark.parametrize("bad", [math.nan, -1.0, math.inf])
def test_unusable_declared_wait_falls_back_to_the_prior(bad: float) -> None:
    assert WaitPredictor().predict("pytest", bad) == DEFAULT_PRIOR


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_converges_on_lognormal_durations(seed: int) -> None:
    rng = np.random.default_rng(seed)
    true_median = 3.0
    samples = rng.lognormal(mean=math.log(true_median), sigma=0.5, size=200)
    predictor = WaitPredictor()
    for value in samples:
        assert predictor.observe("build", float(value))
    est = predictor.predict("build", None)
    assert est.source == "observed"
    assert est.samples == 200
    assert est.p50 == pytest.approx(true_median, rel=0.10)
    # The estimator itself (sketch + seed blend) tracks the sample median much closer than 10%.
    assert est.p50 == pytest.approx(float(np.median(samples)), rel=0.03)
    assert est.p10 == pytest.approx(float(np.quantile(samples, 0.1)), rel=0.10)
    assert est.p90 == pytest.approx(float(np.quantile(samples, 0.9)), rel=0.10)


def test_observations_outweigh_a_wrong_declaration() -> None:
    predictor = WaitPredictor()
    for _ in range(200):
        predictor.observe("fetch", 2.0)
    est = predictor.predict("fetch", 60.0)  # the harness guessed far too long
    assert est.p50 == pytest.approx(2.0, rel=0.10)
    few = WaitPredictor()
    few.observe("fetch", 2.0)
    one = few.predict("fetch", 60.0)
    assert 2.0 < one.p50 < 60.0  # one sample moves it, but not all the way


@pytest.mark.parametrize("bad", [math.nan, -0.5, math.inf, -math.inf])
def test_bad_observations_are_ignored(bad: float) -> None:
    predictor = WaitPredictor()
    assert predictor.observe("x", bad) is False
    assert predictor.tools() == {}
    assert predictor.predict("x", None) == DEFAULT_PRIOR


def test_zero_duration_is_a_valid_observation() -> None:
    predictor = WaitPredictor()
    assert predictor.observe("noop", 0.0)
    est = predictor.predict("noop", None)
    assert est.is_valid()
    assert est.p50 < DEFAULT_PRIOR.p50


def test_tool_table_is_bounded() -> None:
    predictor = WaitPredictor(max_tools=3)
    for name in ("a", "b", "c", "d"):
        predictor.observe(name, 1.0)
    assert set(predictor.tools()) == {"b", "c", "d"}
    predictor.observe("b", 1.0)  # b is now the most recent; c is the oldest
    predictor.observe("e", 1.0)
    assert set(predictor.tools()) == {"b", "d", "e"}


def test_threads_do_not_lose_observations() -> None:
    predictor = WaitPredictor()

    def work() -> None:
        for i in range(500):
            predictor.observe("shared", 1.0 + i % 7)
            predictor.predict("shared", 2.0)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert predictor.tools() == {"shared": 2000}


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.floats(min_value=0.0, max_value=1e6), min_size=0, max_size=50),
    declared=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
)
def test_estimates_are_always_ordered_and_finite(
    values: list[float], declared: float | None
) -> None:
    predictor = WaitPredictor()
    for v in values:
        predictor.observe("t", v)
    est = predictor.predict("t", declared)
    assert est.is_valid()
    assert all(math.isfinite(x) for x in (est.p10, est.p50, est.p90))


# ---- prefetch timing -------------------------------------------------------------------------


def test_prefetch_reference_example() -> None:
    # Median 3 s, minimum 2 s: a timer at 1.8 s starts the reload (reference, "Early Speculative
    # Prefetching"): p10 2.0 - reload 0.15 - margin 0.05.
    est = WaitEstimate(p10=2.0, p50=3.0, p90=5.0, source="observed", samples=100)
    assert prefetch_at(est, reload_s=0.15, margin_s=0.05) == pytest.approx(1.8)


def test_prefetch_never_before_the_pause() -> None:
    est = WaitEstimate(p10=0.1, p50=0.2, p90=0.5, source="observed")
    assert prefetch_at(est, reload_s=1.0) == 0.0
    assert prefetch_at(est, reload_s=math.nan) == 0.0


# ---- outcomes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("done", "resumed", "kwargs", "expected"),
    [
        (10.0, 10.5, {}, "on_time"),
        (10.0, 10.0, {}, "on_time"),
        (10.0, 15.0, {}, "early"),
        (10.0, 15.0, {"early_slack_s": 10.0}, "on_time"),
        (10.0, 9.0, {}, "late"),
        (10.0, 9.95, {"late_tolerance_s": 0.1}, "on_time"),
        (None, 9.0, {}, "late"),
        (math.nan, 9.0, {}, "late"),
        (10.0, None, {}, "wasted"),
        (10.0, math.nan, {}, "wasted"),
        (10.0, 10.5, {"evicted_before_resume": True}, "wasted"),
    ],
)
def test_classify_prefetch(
    done: float | None, resumed: float | None, kwargs: dict[str, object], expected: str
) -> None:
    assert classify_prefetch(done, resumed, **kwargs) == expected  # type: ignore[arg-type]


def test_outcome_counter() -> None:
    counter = PrefetchOutcomeCounter()
    assert counter.counts() == {"early": 0, "on_time": 0, "late": 0, "wasted": 0}
    for outcome in ("early", "late", "late", "wasted", "bogus"):
        counter.record(outcome)  # type: ignore[arg-type]
    assert counter.counts() == {"early": 1, "on_time": 0, "late": 2, "wasted": 1}
    assert counter.total() == 4


def test_parallel_calls_are_predicted_as_the_longest_tool() -> None:
    p = WaitPredictor()
    for _ in range(20):
        p.observe("read_file", 0.5)
        p.observe("run_tests", 40.0)
    assert p.longest(["read_file", "run_tests"]) == "run_tests"
    assert p.longest(["run_tests", "read_file"]) == "run_tests"
    assert p.longest(["new_a", "new_b"]) == "new_a"  # a tie (both the prior): the first
    with pytest.raises(ValueError):
        p.longest([])
