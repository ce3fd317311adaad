"""The no-pause overhead comparison: interleaved order and the median of per-repeat losses."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentkv_bench import overhead
from agentkv_bench.overhead import OverheadSpec, compare, run_interleaved


def test_repeats_alternate_and_each_run_has_its_server_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[str] = []
    up: list[str] = []

    def fake(spec: Any, base_url: str, model: str, tok: str, out: Path, name: str) -> dict:
        assert up == [base_url], up  # exactly one server is up, the one being measured
        calls.append(name)
        return {"output_throughput": 1.0}

    @contextlib.contextmanager
    def open_server(name: str) -> Iterator[tuple[str, str, None]]:
        up.append(f"http://{name}")
        try:
            yield f"http://{name}", "m", None
        finally:
            up.remove(f"http://{name}")

    monkeypatch.setattr(overhead, "run_bench_serve", fake)
    progress: list[tuple[int, int]] = []
    runs = run_interleaved(
        OverheadSpec(repeats=3),
        open_server,
        ("vanilla", "agentkv"),
        "tok",
        tmp_path,
        lambda d, t: progress.append((d, t)),
    )
    assert calls == ["vanilla-0", "agentkv-0", "agentkv-1", "vanilla-1", "vanilla-2", "agentkv-2"]
    assert len(runs["vanilla"]) == len(runs["agentkv"]) == 3
    assert progress[-1] == (6, 6) and up == []


def test_loss_is_the_median_of_paired_repeats() -> None:
    # Throughput drifts between repeats (100 -> 60); pairing cancels the drift.
    runs = {
        "vanilla": [
            {"output_throughput": 100.0},
            {"output_throughput": 80.0},
            {"output_throughput": 60.0},
        ],
        "agentkv": [
            {"output_throughput": 98.0},
            {"output_throughput": 60.0},
            {"output_throughput": 59.4},
        ],
    }
    out = compare(runs, OverheadSpec(repeats=3))
    assert out["status"] == "ok" and out["repeats"] == 3
    assert out["pair_losses_pct"] == [2.0, 25.0, 1.0]
    assert out["throughput_loss_pct"] == pytest.approx(2.0)
    assert out["vanilla"]["output_throughput"] == 80.0
    assert out["agentkv"]["output_throughput"] == 60.0


def test_no_usable_runs_is_failed_not_zero() -> None:
    out = compare({"vanilla": [{"output_throughput": None}], "agentkv": [{}]}, OverheadSpec())
    assert out["status"] == "failed" and out["throughput_loss_pct"] is None
