"""The pause decision: the reference's worked examples, its monotonicity laws, and bad input."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from agentkv.admission import Admission
from agentkv.cli import app
from agentkv.costs import (
    CostModel,
    hold_cost,
    recompute_seconds,
    reload_seconds,
    round_trip_seconds,
)
from agentkv.policy import (
    DEFAULT_POLICY,
    LEASE_MARGIN_S,
    Action,
    Decision,
    PolicyParams,
    break_even_wait,
    decide,
)
from agentkv.predict import WaitEstimate
from agentkv.profile import DEFAULT_PROFILE, HardwareProfile

CONFIGS = Path(__file__).parent / "configs"
L70 = str(CONFIGS / "llama-3.1-70b.json")
runner = CliRunner()

NAPKIN = CostModel(host_link_bytes_per_s=512e9, prefill_flops_per_s=3.56e15, model_params=70.6e9)
FIG10 = CostModel(host_link_bytes_per_s=50e9, prefill_flops_per_s=4.0e14, model_params=70e9)
FIG10_BYTES = 5 * 2**30
DISKY = CostModel(
    host_link_bytes_per_s=50e9,
    disk_write_bytes_per_s=5e9,
    disk_read_bytes_per_s=10e9,
    prefill_flops_per_s=4.0e14,
    model_params=70e9,
)


def run_json(*args: str) -> dict[str, Any]:
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# ---- worked examples ----------------------------------------------------------------------


def test_napkin_06_forty_five_second_wait() -> None:
    d = decide(tokens=32_768, kv_bytes=10.7e9, wait=45.0, costs=NAPKIN, pressure=1.0)
    assert d.action == "offload_host"
    assert d.reload_s == pytest.approx(0.021, abs=0.0005)
    assert d.round_trip_s == pytest.approx(0.042, abs=0.001)
    assert d.recompute_s == pytest.approx(1.3, abs=0.005)
    assert d.recompute_over_reload == pytest.approx(62, abs=0.5)
    assert d.hold_cost_byte_s == pytest.approx(483e9, rel=0.01)
    assert d.break_even_wait_s == pytest.approx(d.round_trip_s)
    assert d.lease_s == 0.0


def test_napkin_06_quarter_bandwidth_still_wins_15x() -> None:
    quarter = CostModel(
        host_link_bytes_per_s=128e9, prefill_flops_per_s=3.56e15, model_params=70.6e9
    )
    d = decide(tokens=32_768, kv_bytes=10.7e9, wait=45.0, costs=quarter, pressure=1.0)
    assert d.recompute_over_reload == pytest.approx(15.5, abs=0.2)


def test_figure_10_break_even_and_ratio() -> None:
    d = decide(tokens=16_384, kv_bytes=FIG10_BYTES, wait=45.0, costs=FIG10, pressure=1.0)
    assert d.action == "offload_host"
    assert d.round_trip_s == pytest.approx(0.215, abs=0.001)
    assert d.recompute_s == pytest.approx(5.735, abs=0.002)
    assert d.recompute_over_reload == pytest.approx(53.6, rel=0.01)
    assert d.break_even_wait_s == pytest.approx(0.215, abs=0.001)


def test_figure_10_short_pause_is_retained_with_a_lease() -> None:
    # The reference's model has no lease margin; the default (LEASE_MARGIN_S) adds one.
    bare = PolicyParams(lease_margin_s=0.0)
    d = decide(
        tokens=16_384, kv_bytes=FIG10_BYTES, wait=0.1, costs=FIG10, pressure=1.0, params=bare
    )
    assert d.action == "retain"
    assert d.lease_s == pytest.approx(d.break_even_wait_s)
    default = decide(tokens=16_384, kv_bytes=FIG10_BYTES, wait=0.1, costs=FIG10, pressure=1.0)
    assert default.lease_s == pytest.approx(0.1 + LEASE_MARGIN_S)
    assert d.prefetch_at_s is None
    assert d.expected_resume_stall_s == 0.0


def test_cli_reproduces_napkin_06() -> None:
    out = run_json(
        "decide", "--tokens", "32768", "--kv-bytes", "10.7GB", "--params", "70.6e9",
        "--prefill-flops", "3.56e15", "--link-bytes-per-s", "512GB", "--wait", "45",
    )  # fmt: skip
    assert out["action"] == "offload_host"
    assert out["reload_s"] == pytest.approx(0.021, abs=0.0005)
    assert out["round_trip_s"] == pytest.approx(0.042, abs=0.001)
    assert out["recompute_s"] == pytest.approx(1.3, abs=0.005)
    assert out["break_even_wait_s"] == pytest.approx(0.042, abs=0.001)
    assert out["hold_cost_byte_s"] == pytest.approx(481.5e9)


def test_cli_reproduces_figure_10() -> None:
    out = run_json(
        "decide", "--tokens", "16384", "--kv-bytes", "5GiB", "--params", "70e9",
        "--prefill-flops", "4e14", "--link-bytes-per-s", "50e9", "--wait", "45",
    )  # fmt: skip
    assert out["round_trip_s"] == pytest.approx(0.215, abs=0.001)
    assert out["recompute_s"] == pytest.approx(5.735, abs=0.002)
    assert out["recompute_over_reload"] == pytest.approx(53.6, rel=0.01)


def test_cli_model_config_adds_the_attention_term() -> None:
    out = run_json(
        "decide", "--tokens", "32768", "--model", L70, "--prefill-flops", "3.56e15",
        "--link-bytes-per-s", "512e9", "--wait", "45",
    )  # fmt: skip
    assert out["kv_bytes"] == 32_768 * 327_680
    assert out["reload_s"] == pytest.approx(0.021, abs=0.0005)
    s, p, layers, d_model = 32_768, 70_553_706_496, 80, 8192
    expected = (2 * p * s + 4 * layers * s * s * d_model) / 3.56e15
    assert out["recompute_s"] == pytest.approx(expected, rel=1e-9)
    assert out["recompute_s"] > 1.3 + 0.7  # the quadratic term is not negligible at 32k


def test_cli_measured_prefill_rate() -> None:
    out = run_json(
        "decide", "--tokens", "8000", "--kv-bytes", "1GB", "--prefill-tokens-per-s", "4000",
        "--link-bytes-per-s", "10GB", "--wait", "30",
    )  # fmt: skip
    assert out["recompute_s"] == pytest.approx(2.0)


def test_cli_human_output_names_the_numbers() -> None:
    result = runner.invoke(
        app,
        ["decide", "--tokens", "16384", "--kv-bytes", "5GiB", "--params", "70e9",
         "--prefill-flops", "4e14", "--link-bytes-per-s", "50e9", "--wait", "45"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    for word in ("offload_host", "round trip", "recompute", "break-even", "214.7 ms"):
        assert word in result.output


# ---- the formulas --------------------------------------------------------------------------


def test_formulas() -> None:
    assert reload_seconds(10e9, 5e9) == 2.0
    assert round_trip_seconds(10e9, 5e9) == 4.0
    assert reload_seconds(10e9, 0.0) == math.inf
    assert recompute_seconds(1000, params=1e9, prefill_flops_per_s=2e12) == 1.0
    assert recompute_seconds(
        1000, params=1e9, prefill_flops_per_s=2e12, num_layers=2, hidden_size=3
    ) == (pytest.approx((2e12 + 4 * 2 * 1000 * 1000 * 3) / 2e12))
    assert recompute_seconds(1000, prefill_tokens_per_s=500.0) == 2.0
    assert recompute_seconds(1000) == math.inf
    assert hold_cost(6e9, 60.0) == 360e9  # the reference's 360 GB·s


def test_break_even_follows_the_shadow_price() -> None:
    params = PolicyParams(dram_to_hbm_price_ratio=0.25, stall_tolerance_s=0.0)
    assert break_even_wait(0.2, 1.0, params) == pytest.approx(0.2)
    assert break_even_wait(0.2, 0.0, params) == pytest.approx(0.2 / 0.75)
    assert break_even_wait(0.2, 0.5, params) == pytest.approx(0.2 / (1 - 0.125))
    tolerant = PolicyParams(stall_tolerance_s=0.05)
    assert break_even_wait(0.2, 1.0, tolerant) == pytest.approx(0.25)


def test_low_pressure_retains_longer_waits() -> None:
    wait = 0.25  # between the round trip (0.215) and T* at U=0 (0.286)
    idle = decide(tokens=16_384, kv_bytes=FIG10_BYTES, wait=wait, costs=FIG10, pressure=0.0)
    full = decide(tokens=16_384, kv_bytes=FIG10_BYTES, wait=wait, costs=FIG10, pressure=1.0)
    assert idle.action == "retain"
    assert full.action == "offload_host"


# ---- tiers ---------------------------------------------------------------------------------


def test_long_wait_goes_to_disk_and_prefetches_early() -> None:
    wait = WaitEstimate(p10=1200.0, p50=3600.0, p90=10_800.0, source="observed", samples=50)
    d = decide(tokens=16_384, kv_bytes=FIG10_BYTES, wait=wait, costs=DISKY, pressure=0.5)
    assert d.action == "offload_disk"
    disk_reload = FIG10_BYTES / 10e9 + FIG10_BYTES / 50e9
    assert d.reload_s == pytest.approx(disk_reload)
    assert d.prefetch_at_s == pytest.approx(1200.0 - disk_reload - DEFAULT_POLICY.prefetch_margin_s)
    assert d.expected_resume_stall_s == 0.0


def test_host_full_falls_to_disk_then_drop() -> None:
    common: dict[str, Any] = dict(
        tokens=16_384, kv_bytes=FIG10_BYTES, wait=45.0, costs=DISKY, pressure=1.0
    )
    assert decide(**common, host_free_bytes=0).action == "offload_disk"
    d = decide(**common, host_free_bytes=0, disk_free_bytes=FIG10_BYTES - 1)
    assert d.action == "drop"
    assert "no tier" in d.rationale
    assert decide(**common, host_free_bytes=FIG10_BYTES).action == "offload_host"


def test_drop_when_recompute_beats_reload() -> None:
    # A small model on a slow link: rebuilding is faster than reading back.
    costs = CostModel(host_link_bytes_per_s=1e8, prefill_tokens_per_s=50_000.0)
    d = decide(tokens=1000, kv_bytes=1e9, wait=60.0, costs=costs, pressure=1.0)
    assert d.action == "drop"
    assert d.recompute_s == pytest.approx(0.02)
    assert "recompute beats" in d.rationale


def test_cost_model_from_profile() -> None:
    gpu = HardwareProfile(
        host_copy_bytes_per_s=20e9, host_to_device_bytes_per_s=50e9, device_to_host_bytes_per_s=40e9
    )
    assert CostModel.from_profile(gpu).host_link_bytes_per_s == 40e9
    cpu = CostModel.from_profile(DEFAULT_PROFILE, model_params=1e9)
    assert cpu.host_link_bytes_per_s == DEFAULT_PROFILE.host_copy_bytes_per_s
    assert cpu.recompute_seconds(100) == math.inf  # the defaults know no prefill rate


def test_to_dict_is_strict_json() -> None:
    d = decide(
        tokens=10,
        kv_bytes=1e6,
        wait=math.inf,
        costs=CostModel(host_link_bytes_per_s=1e9),
        pressure=0.2,
    )
    text = json.dumps(d.to_dict(), allow_nan=False)
    data = json.loads(text)
    for key in (
        "action",
        "reload_s",
        "round_trip_s",
        "recompute_s",
        "break_even_wait_s",
        "hold_cost_byte_s",
    ):
        assert key in data
    assert data["recompute_s"] is None  # unknown, so infinite, so null


# ---- bad input on the engine's path ------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(wait=math.nan), "wait"),
        (dict(wait=-3.0), "wait"),
        (dict(wait=WaitEstimate(5.0, 1.0, 9.0, "observed")), "wait estimate"),
        (dict(pressure=math.nan), "pressure"),
        (dict(pressure=7.0), "pressure"),
        (dict(costs=CostModel(host_link_bytes_per_s=0.0)), "host link"),
        (dict(costs=CostModel(host_link_bytes_per_s=math.nan)), "host link"),
        (dict(kv_bytes=math.nan), "kv_bytes"),
        (dict(tokens=-5), "tokens"),
        (dict(host_free_bytes=math.nan), "host free"),
        (dict(costs=None), "internal error"),
    ],
)
def test_bad_input_never_raises_and_says_why(kwargs: dict[str, Any], fragment: str) -> None:
    base: dict[str, Any] = dict(
        tokens=16_384, kv_bytes=FIG10_BYTES, wait=45.0, costs=FIG10, pressure=0.5
    )
    d = decide(**{**base, **kwargs})
    assert isinstance(d, Decision)
    assert d.fallbacks
    assert fragment in d.rationale
    json.dumps(d.to_dict(), allow_nan=False)


def test_unknown_wait_offloads_write_back_at_once() -> None:
    d = decide(tokens=16_384, kv_bytes=FIG10_BYTES, wait=None, costs=FIG10, pressure=0.1)
    assert d.action == "offload_host"
    assert d.prefetch_at_s == 0.0


def test_zero_bandwidth_everywhere_drops() -> None:
    d = decide(
        tokens=16_384, kv_bytes=FIG10_BYTES, wait=45.0,
        costs=CostModel(host_link_bytes_per_s=0.0, prefill_flops_per_s=4e14, model_params=70e9),
        pressure=1.0,
    )  # fmt: skip
    assert d.action == "drop"


def test_decide_is_cheap() -> None:
    wait = WaitEstimate(1.0, 3.0, 9.0, "observed", 10)
    n = 2000
    start = time.perf_counter()
    for _ in range(n):
        decide(tokens=16_384, kv_bytes=FIG10_BYTES, wait=wait, costs=DISKY, pressure=0.5,
               host_free_bytes=1e12, disk_free_bytes=1e13)  # fmt: skip
    per_call = (time.perf_counter() - start) / n
    assert per_call < 500e-6  # ~10 µs here; generous for a loaded 2-core CI box


# ---- laws (hypothesis) ---------------------------------------------------------------------

sizes = st.floats(min_value=1e3, max_value=1e12)
rates = st.floats(min_value=1e6, max_value=1e13)
waits = st.floats(min_value=0.0, max_value=1e6)
fractions = st.floats(min_value=0.0, max_value=1.0)
free = st.one_of(st.none(), st.floats(min_value=0.0, max_value=1e13))


@st.composite
def cost_models(draw: st.DrawFn) -> CostModel:
    return CostModel(
        host_link_bytes_per_s=draw(rates),
        disk_write_bytes_per_s=draw(st.one_of(st.none(), rates)),
        disk_read_bytes_per_s=draw(rates),
        prefill_flops_per_s=draw(st.floats(min_value=1e9, max_value=1e16)),
        model_params=draw(st.floats(min_value=1e6, max_value=1e12)),
    )


@settings(max_examples=300, deadline=None)
@given(m=sizes, costs=cost_models(), w1=waits, w2=waits, u=fractions, hf=free, df=free)
def test_longer_wait_never_turns_offload_into_retain(
    m: float, costs: CostModel, w1: float, w2: float, u: float, hf: float | None, df: float | None
) -> None:
    short, long = sorted((w1, w2))
    kw: dict[str, Any] = dict(
        tokens=4096, kv_bytes=m, costs=costs, pressure=u, host_free_bytes=hf, disk_free_bytes=df
    )
    if decide(wait=short, **kw).action != "retain":
        assert decide(wait=long, **kw).action != "retain"


@settings(max_examples=300, deadline=None)
@given(m=sizes, b1=rates, b2=rates, u=fractions, costs=cost_models(), hf=free)
def test_more_bandwidth_never_raises_break_even(
    m: float, b1: float, b2: float, u: float, costs: CostModel, hf: float | None
) -> None:
    slow, fast = sorted((b1, b2))
    kw: dict[str, Any] = dict(tokens=4096, kv_bytes=m, wait=10.0, pressure=u, host_free_bytes=hf)
    t_slow = decide(costs=_with_link(costs, slow), **kw).break_even_wait_s
    t_fast = decide(costs=_with_link(costs, fast), **kw).break_even_wait_s
    assert t_fast <= t_slow * (1 + 1e-12)
    assert break_even_wait(round_trip_seconds(m, fast), u) <= break_even_wait(
        round_trip_seconds(m, slow), u
    )


def _with_link(costs: CostModel, link: float) -> CostModel:
    return CostModel(
        host_link_bytes_per_s=link,
        disk_write_bytes_per_s=costs.disk_write_bytes_per_s,
        disk_read_bytes_per_s=costs.disk_read_bytes_per_s,
        prefill_flops_per_s=costs.prefill_flops_per_s,
        model_params=costs.model_params,
    )


@settings(max_examples=300, deadline=None)
@given(m=sizes, costs=cost_models(), w=waits, u1=fractions, u2=fractions, hf=free, df=free)
def test_more_pressure_never_lengthens_a_lease(
    m: float, costs: CostModel, w: float, u1: float, u2: float, hf: float | None, df: float | None
) -> None:
    low, high = sorted((u1, u2))
    kw: dict[str, Any] = dict(
        tokens=4096, kv_bytes=m, wait=w, costs=costs, host_free_bytes=hf, disk_free_bytes=df
    )
    assert decide(pressure=high, **kw).lease_s <= decide(pressure=low, **kw).lease_s


any_float = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.none())


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.integers(min_value=-10, max_value=10**7),
    m=any_float, w=any_float, u=any_float, link=any_float, hf=any_float, df=any_float,
)  # fmt: skip
def test_decide_never_raises(
    tokens: int, m: Any, w: Any, u: Any, link: Any, hf: Any, df: Any
) -> None:
    costs = CostModel(
        host_link_bytes_per_s=link, disk_write_bytes_per_s=link, disk_read_bytes_per_s=link
    )
    d = decide(
        tokens=tokens,
        kv_bytes=m,
        wait=w,
        costs=costs,
        pressure=u,
        host_free_bytes=hf,
        disk_free_bytes=df,
    )
    assert d.action in ("retain", "offload_host", "offload_disk", "drop")
    assert d.lease_s >= 0
    json.dumps(d.to_dict(), allow_nan=False)


# ---- CLI bad input -----------------------------------------------------------------------

GOOD = ["decide", "--tokens", "16384", "--kv-bytes", "5GiB", "--params", "70e9",
        "--prefill-flops", "4e14", "--link-bytes-per-s", "50e9", "--wait", "45"]  # fmt: skip


def _replace(args: list[str], flag: str, value: str) -> list[str]:
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


@pytest.mark.parametrize(
    "args",
    [
        _replace(GOOD, "--wait", "nan"),
        _replace(GOOD, "--wait", "-1"),
        _replace(GOOD, "--link-bytes-per-s", "0"),
        _replace(GOOD, "--link-bytes-per-s", "fast"),
        _replace(GOOD, "--kv-bytes", "5G"),
        _replace(GOOD, "--tokens", "0"),
        _replace(GOOD, "--prefill-flops", "-4e14"),
        [*GOOD, "--pressure", "1.5"],
        [*GOOD, "--prefill-tokens-per-s", "1000"],
        [*GOOD, "--model", L70],
        [*GOOD, "--disk-write-bytes-per-s", "5GB"],
        ["decide", "--tokens", "100", "--prefill-flops", "1e14", "--link-bytes-per-s", "1e9", "--wait", "1"],
        ["decide", "--tokens", "100", "--kv-bytes", "1GB", "--prefill-flops", "1e14",
         "--link-bytes-per-s", "1e9", "--wait", "1"],
        ["decide", "--tokens", "100", "--model", str(CONFIGS / "missing.json"), "--prefill-flops", "1e14",
         "--link-bytes-per-s", "1e9", "--wait", "1"],
    ],
)  # fmt: skip
def test_cli_rejects_nonsense_with_exit_2(args: list[str]) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output


# ---- the admission picture: retain only when the lease delays no waiting request ----------


def _short_wait(admission: Admission | None) -> Decision:
    # A 0.05 s wait under a 0.43 s round trip: retain on its own merits.
    return decide(
        tokens=16_384,
        kv_bytes=FIG10_BYTES,
        wait=0.05,
        costs=FIG10,
        pressure=0.5,
        admission=admission,
    )


def test_retain_when_the_waiting_queue_fits() -> None:
    d = _short_wait(Admission(waiting=2, blocks_needed=10, free_blocks=40))
    assert d.action == Action.RETAIN
    assert "delays no waiting request (2 waiting need 10 blocks, 40 free)" in d.rationale


def test_a_queue_short_of_blocks_calls_the_retain_in() -> None:
    d = _short_wait(Admission(waiting=3, blocks_needed=50, free_blocks=8))
    assert d.action == Action.OFFLOAD_HOST
    assert d.lease_s == 0.0
    assert "retain would delay waiting requests (3 waiting need 50 blocks, 8 free)" in d.rationale


def test_a_preemption_counts_as_a_blocked_queue() -> None:
    d = _short_wait(Admission(free_blocks=100, preempted=1))
    assert d.action == Action.OFFLOAD_HOST
    assert "1 preempted" in d.rationale


def test_no_admission_picture_keeps_the_old_decision() -> None:
    assert _short_wait(None).action == Action.RETAIN
    assert _short_wait(Admission()).action == Action.RETAIN


@given(
    waiting=st.integers(0, 50),
    needed=st.integers(0, 500),
    free=st.integers(0, 500),
    preempted=st.integers(0, 3),
    wait=st.floats(0.0, 1e4),
)
@settings(max_examples=200, deadline=None)
def test_never_retain_while_the_queue_is_blocked(
    waiting: int, needed: int, free: int, preempted: int, wait: float
) -> None:
    adm = Admission(waiting, needed, free, preempted)
    d = decide(
        tokens=16_384, kv_bytes=FIG10_BYTES, wait=wait, costs=FIG10, pressure=0.3, admission=adm
    )
    if adm.blocked:
        assert d.action != Action.RETAIN
    else:
        assert d.action == _short_wait_at(wait).action


def _short_wait_at(wait: float) -> Decision:
    return decide(tokens=16_384, kv_bytes=FIG10_BYTES, wait=wait, costs=FIG10, pressure=0.3)
