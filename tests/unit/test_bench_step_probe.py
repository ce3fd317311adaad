"""``agentkv bench overhead --step-times``: the probe that times vLLM's own engine-core and worker
methods inside a server, and what the report makes of its records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentkv_bench import step_probe
from agentkv_bench.phased import PhasedOptions, _phase_spec, build_report, to_markdown
from agentkv_bench.step_probe_site import sitecustomize as probe

STEP, FWD, SCHED = "EngineCore.step", "GPUModelRunner._model_forward", "Scheduler.schedule"


def test_the_probe_times_a_target_method_once_its_module_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "probe_demo_engine.py").write_text(
        textwrap.dedent(
            """
            class EngineCore:
                def step(self, x):
                    return x + 1
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(probe, "TARGETS", (("probe_demo_engine", "EngineCore", "step"),))
    records = tmp_path / "records"
    records.mkdir()
    before = list(sys.meta_path)
    try:
        probe.install(str(records))
        import probe_demo_engine  # type: ignore[import-not-found]

        engine = probe_demo_engine.EngineCore()
        assert [engine.step(i) for i in range(300)] == list(range(1, 301))  # behaviour kept
    finally:
        sys.meta_path[:] = before
        sys.modules.pop("probe_demo_engine", None)
    got = step_probe.read_records(records)
    # Written in batches of 128 records: nothing is written per call.
    assert len(got) == 256
    assert {key for key, _, _ in got} == {STEP}
    assert all(seconds >= 0 for _, _, seconds in got)


def test_extra_targets_are_timed_and_named_for_the_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "probe_demo_control.py").write_text(
        textwrap.dedent(
            """
            class ControlOps:
                def handle(self, req):
                    return 200, req
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(probe, "TARGETS", (("probe_demo_nothing", "EngineCore", "step"),))
    monkeypatch.setattr(step_probe, "KEYS", ("EngineCore.step",))
    records = tmp_path / "records"
    records.mkdir()
    before = list(sys.meta_path)
    try:
        probe.install(str(records), "probe_demo_control:ControlOps.handle")
        import probe_demo_control  # type: ignore[import-not-found]

        ops = probe_demo_control.ControlOps()
        assert [ops.handle(i) for i in range(128)] == [(200, i) for i in range(128)]
    finally:
        sys.meta_path[:] = before
        sys.modules.pop("probe_demo_control", None)
    got = step_probe.read_records(records)
    assert [key for key, _, _ in got] == ["ControlOps.handle"] * 128


def test_garbage_collections_are_recorded_by_generation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc

    monkeypatch.setattr(probe, "TARGETS", (("probe_demo_nothing", "EngineCore", "step"),))
    monkeypatch.setattr(step_probe, "KEYS", ("EngineCore.step",))
    before, callbacks = list(sys.meta_path), list(gc.callbacks)
    try:
        probe.install(str(tmp_path), collections=True)
        for _ in range(128):
            gc.collect(2)
    finally:
        sys.meta_path[:] = before
        gc.callbacks[:] = callbacks
    got = step_probe.read_records(tmp_path)
    assert len(got) == 128 and {key for key, _, _ in got} == {"gc.gen2"}
    assert all(seconds >= 0 for _, _, seconds in got)


@pytest.mark.parametrize("bad", ["nocolon.Class.method", "mod:Class", "mod:.method"])
def test_a_malformed_extra_target_is_refused_by_name(bad: str) -> None:
    with pytest.raises(ValueError, match=probe.EXTRA_ENV):
        probe.parse_extra(bad)


def test_a_server_process_loads_the_probe_into_vllm(tmp_path: Path) -> None:
    """Guards the target list against vLLM renames: a probe that wraps nothing reports nothing."""
    pytest.importorskip("vllm")
    env = {**os.environ, **step_probe.probe_env(tmp_path, os.environ.get("PYTHONPATH"))}
    code = (
        "import importlib, json; from agentkv_bench.step_probe_site.sitecustomize import TARGETS;"
        "print(json.dumps([hasattr(getattr(getattr(importlib.import_module(m), c), f), "
        "'__wrapped__') for m, c, f in TARGETS]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True] * len(probe.TARGETS)


def test_a_phase_keeps_the_calls_inside_its_window_and_derives_the_step_outside_the_forward() -> (
    None
):
    records = [
        (STEP, 9.0, 1.0),  # before the window (warm-up)
        (STEP, 10.0, 0.004),
        (STEP, 10.1, 0.006),
        (STEP, 10.2, 0.005),
        (FWD, 10.0, 0.003),
        (FWD, 10.1, 0.004),
        (SCHED, 10.0, 40e-6),
        (STEP, 21.0, 1.0),  # after it (the flush requests)
    ]
    got = step_probe.phase_step_times(records, 10.0, 20.0)
    assert got[STEP] == {"n": 3, "median_us": pytest.approx(5000.0)}
    assert got[FWD]["median_us"] == pytest.approx(3500.0)
    assert got[step_probe.OUTSIDE]["median_us"] == pytest.approx(1500.0)
    assert got[SCHED]["n"] == 1


def _phase(r: int, config: str, step: float, fwd: float, sched: float) -> dict[str, object]:
    return {
        "round": r,
        "config": config,
        "latencies_s": [0.1],
        "step_times": {
            STEP: {"n": 10, "median_us": step},
            FWD: {"n": 10, "median_us": fwd},
            SCHED: {"n": 10, "median_us": sched},
            step_probe.OUTSIDE: {"n": 10, "median_us": step - fwd},
        },
    }


def test_rounds_are_compared_pairwise_so_a_slow_start_cancels_out() -> None:
    phases = [
        _phase(0, "vanilla", 4400, 3000, 40),
        _phase(0, "agentkv", 4450, 3000, 60),
        # A start whose forward ran 10% slow: the step moves, its part outside the forward not.
        _phase(1, "agentkv", 4750, 3300, 62),
        _phase(1, "vanilla", 4400, 3000, 40),
        _phase(2, "vanilla", 4420, 3010, 41),
        _phase(2, "agentkv", 4480, 3010, 61),
    ]
    got = step_probe.compare_step_times(phases)
    rows = got["targets"]
    assert rows[SCHED]["diff_us"] == pytest.approx(20.0)
    assert rows[step_probe.OUTSIDE]["diff_us"] == pytest.approx(50.0)
    assert rows[step_probe.OUTSIDE]["diff_range_us"] == [50.0, 60.0]
    assert rows[STEP]["diff_us"] == pytest.approx(60.0)
    assert got["added_share_of_step"] == pytest.approx(50.0 / 4400)
    rep = build_report(command="c", machine={}, options={}, phases=phases, resamples=50)
    assert rep["step_times"] == got
    md = to_markdown(rep)
    assert "**+50 us**" in md and "| Scheduler.schedule | 40 | 61 | +20 (+20 to +22) |" in md


def test_a_report_without_probe_records_has_no_step_times() -> None:
    phases = [{"round": 0, "config": c, "latencies_s": [0.1]} for c in ("vanilla", "agentkv")]
    rep = build_report(command="c", machine={}, options={}, phases=phases)
    assert rep["step_times"] is None
    assert "Step times" not in to_markdown(rep)
    assert step_probe.step_times_markdown({"targets": {}})[0].startswith("Step times: no probe")


def test_a_probed_phase_starts_its_server_with_the_probe(tmp_path: Path) -> None:
    opts = PhasedOptions(out=tmp_path / "out")
    spec = _phase_spec(opts, "/m", tmp_path, "agentkv", 0, tmp_path / "p")
    assert spec.extra_env[probe.ENV] == str(tmp_path / "p")
    assert spec.extra_env["PYTHONPATH"].split(os.pathsep)[0] == str(step_probe.SITE_DIR)
    assert (step_probe.SITE_DIR / "sitecustomize.py").is_file()
    plain = _phase_spec(opts, "/m", tmp_path, "vanilla", 0)
    assert probe.ENV not in plain.extra_env and "PYTHONPATH" not in plain.extra_env


def test_the_null_connector_baseline_starts_vllm_with_a_connector_that_does_nothing(
    tmp_path: Path,
) -> None:
    from agentkv_bench.phased import Baseline

    opts = PhasedOptions(out=tmp_path / "out", baseline=Baseline.NULL_CONNECTOR)
    spec = _phase_spec(opts, "/m", tmp_path, "vanilla", 0)
    assert spec.connector_config is None  # no agentkv plugin on the baseline
    i = list(spec.extra_args).index("--kv-transfer-config")
    cfg = json.loads(spec.extra_args[i + 1])
    assert cfg["kv_connector"] == "NullConnector"
    assert cfg["kv_connector_module_path"] == "agentkv_bench.null_connector"
    assert _phase_spec(opts, "/m", tmp_path, "agentkv", 0).extra_args == []
    assert _phase_spec(PhasedOptions(out=tmp_path), "/m", tmp_path, "vanilla", 0).extra_args == []
    rep = build_report(
        command="c",
        machine={},
        options={"baseline": Baseline.NULL_CONNECTOR.value},
        phases=[{"round": 0, "config": c, "latencies_s": [0.1]} for c in ("vanilla", "agentkv")],
        resamples=10,
    )
    assert "do-nothing KV connector" in to_markdown(rep)
    pytest.importorskip("vllm")
    from agentkv_bench.null_connector import NullConnector

    assert NullConnector.get_num_new_matched_tokens(None, None, 5) == (0, False)  # type: ignore[arg-type]


def test_a_forked_child_writes_only_its_own_records(tmp_path: Path) -> None:
    sink = probe._Sink(str(tmp_path))
    for i in range(10):
        sink.add(0, float(i), 0.001)  # below a batch: still buffered at the fork
    pid = os.fork()
    if pid == 0:  # the child: a batch of its own, then gone without the parent's cleanup
        for i in range(128):
            sink.add(1, 100.0 + i, 0.002)
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    sink.flush()
    files = {p.name: p for p in tmp_path.glob("probe-*.bin")}
    assert set(files) == {f"probe-{os.getpid()}.bin", f"probe-{pid}.bin"}
    mine = step_probe.read_records(tmp_path)
    assert sorted(k for k, _, _ in mine).count(probe.KEYS[0]) == 10
    assert sorted(k for k, _, _ in mine).count(probe.KEYS[1]) == 128  # not 138
