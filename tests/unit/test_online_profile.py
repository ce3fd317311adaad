"""Online calibration: measured rates replace the profile's once enough samples arrived."""

from __future__ import annotations

import math

from agentkv.costs import CostModel
from agentkv.online_profile import ONLINE, OnlineProfile, RollingRate


def test_rolling_median_ignores_outliers_and_ages_out() -> None:
    rate = RollingRate(window=5)
    for seconds in (1.0, 1.0, 1.0, 100.0, 1.0):  # one stall among five steps
        rate.add(1000, seconds)
    assert rate.value() == 1000.0
    for _ in range(5):
        rate.add(2000, 1.0)
    assert rate.value() == 2000.0  # the window moved on
    rate.add(0, 1.0)
    rate.add(10, 0.0)
    assert rate.count == 10  # unusable samples are not counted


def test_default_profile_gets_a_finite_recompute_after_a_few_prefill_steps() -> None:
    base = CostModel(host_link_bytes_per_s=1e9)
    online = OnlineProfile("default", min_samples=3)
    assert math.isinf(online.costs(base).recompute_seconds(1000))
    online.observe_prefill(2000, 1.0)
    online.observe_prefill(2000, 1.0)
    assert online.costs(base) is base  # two samples: not yet
    online.observe_prefill(4000, 1.0)
    live = online.costs(base)
    assert live.prefill_tokens_per_s == 2000.0
    assert live.recompute_seconds(1000) == 0.5
    view = online.view(base)
    assert view["prefill_tokens_per_s"] == {"value": 2000.0, "source": ONLINE, "samples": 3}
    assert view["host_link_bytes_per_s"]["source"] == "default"
    assert view["disk_read_bytes_per_s"]["source"] == "unknown"


def test_host_link_is_the_slower_measured_direction_and_disk_rates_are_separate() -> None:
    base = CostModel(host_link_bytes_per_s=1e9, disk_read_bytes_per_s=1e8)
    online = OnlineProfile("calibrate file", min_samples=1)
    online.observe_transfer("offload", "host", 4_000_000, 0.001)  # 4 GB/s
    online.observe_transfer("reload", "host", 2_000_000, 0.001)  # 2 GB/s
    online.observe_transfer("reload", "disk", 500_000, 0.001)
    online.observe_transfer("promote", "host", 1, 1.0)  # not a device<->tier transfer
    live = online.costs(base)
    assert live.host_link_bytes_per_s == 2e9
    assert live.disk_read_bytes_per_s == 5e8
    assert live.disk_write_bytes_per_s is None
    assert online.view(base)["disk_write_bytes_per_s"]["source"] == "unknown"
