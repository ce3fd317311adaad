"""The simulator's validation protocol on the command line (docs/simulate.md, "Validation
protocol"): measure the engine under load, predict a row before it runs, compare.

Primitives:
    calibrate_load   ``agentkv calibrate --load``: measure the engine at a server under load and
                     write its profile (``agentkv.simulate.engine_profile``).
    validate_cmd     ``agentkv simulate validate``: write a row's prediction (``--predict``), or
                     print predicted vs measured for every row with its commit.
    fit_builtin_cmd  ``agentkv simulate fit-builtin MEASURED``: the built-in calibration's two
                     fitted constants re-derived from the run they were fitted to.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from agentkv.cli.common import fail
from agentkv.cli.simulate_report import print_validation
from agentkv.cli.simulate_workload import bench_workload, build_workload


def calibrate_load(
    server: str,
    model: str | None,
    max_batched_tokens: int,
    output: Path | None,
    as_json: bool,
    quick: bool = False,
) -> None:
    """``agentkv calibrate --load``: measure the engine at ``server`` under load and write its
    profile (``agentkv.simulate.engine_profile``)."""
    from rich.console import Console

    from agentkv.errors import AgentKVError
    from agentkv.simulate.costs import BENCH_SMALL_CPU
    from agentkv.simulate.engine_profile import build_profile, measure_under_load

    err = Console(stderr=True)
    target = output if output is not None else Path("engine_profile.json")
    try:
        with err.status("calibrating under load") as status:
            samples = measure_under_load(
                server,
                model=model,
                max_batched_tokens=max_batched_tokens,
                progress=lambda line: status.update(f"measuring {line}"),
                quick=quick,
            )
        profile = build_profile(samples, BENCH_SMALL_CPU)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(profile, indent=1), encoding="utf-8")
    except (AgentKVError, OSError) as exc:
        fail(str(exc))
    for note in profile["notes"]:
        err.print(f"[yellow]fit:[/] {note}", soft_wrap=True)
    if as_json:
        typer.echo(json.dumps({"profile": profile, "path": str(target)}))
        return
    costs = profile["costs"]
    typer.echo(
        f"engine profile of {profile['model']} written to {target}: linear "
        f"{costs['prefill_flops_per_s']:.3g} FLOP/s, attention {costs['attention_flops_per_s']:.3g}"
        f" FLOP/s, decode step {costs['step_overhead_s'] * 1e3:.1f} ms + "
        f"{costs['decode_seq_s'] * 1e3:.2f} ms per sequence; admission {profile['samples']['admission']}"
    )


def _show_table(as_json: bool) -> None:
    """Every row, predicted vs measured, with the commit of its prediction."""
    from agentkv.simulate import protocol

    rows = protocol.table_rows()
    if as_json:
        typer.echo(json.dumps(rows))
    else:
        print_validation(rows)


def validate_cmd(
    predict_row: str | None = typer.Option(
        None,
        "--predict",
        help="Write the prediction of row NAME to bench/results/predictions/NAME.json (commit "
        "it before running the printed bench command). Without it: the table of every row.",
    ),
    trace: Path | None = typer.Option(
        None, "--trace", exists=True, dir_okay=False, help="The row's trace (default: the bench)."
    ),
    token_scale: float | None = typer.Option(
        None, "--token-scale", min=0.0001, help="A trace row's token scale (default 1)."
    ),
    time_scale: float | None = typer.Option(
        None,
        "--time-scale",
        min=0.0,
        help="The trace's time scale (default 1), or the bench generator's (its default 0.1).",
    ),
    sessions: int | None = typer.Option(
        None, "--sessions", min=1, help="A trace row: only its first N sessions."
    ),
    num_blocks: int = typer.Option(128, "--num-blocks", min=1, help="The row's pool."),
    host_capacity_gib: float = typer.Option(2.0, "--host-capacity-gib", min=0.1),
    calibration: Path | None = typer.Option(
        None,
        "--calibration",
        exists=True,
        dir_okay=False,
        help="Engine profile (`agentkv calibrate --load`); a report of the same run is allowed "
        "but the row is then not held out.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """Predictions before runs (docs/simulate.md, "Validation protocol"): write a row's
    prediction, or print predicted vs measured for every row with its commit."""
    from agentkv.cli.simulate_workload import BENCH_TOKEN_SCALE
    from agentkv.errors import AgentKVError
    from agentkv.simulate import protocol
    from agentkv.simulate.costs import BENCH_SMALL_CPU, load_calibration
    from agentkv_bench.workload import WorkloadConfig

    if predict_row is None:
        _show_table(as_json)
        return
    if trace is None and (token_scale is not None or sessions is not None):
        fail(
            "--token-scale and --sessions apply to a --trace row (the bench generator has neither)"
        )
    try:
        costs = load_calibration(calibration) if calibration is not None else BENCH_SMALL_CPU
        # The generator's token scale is the bench's prompt tokens per target token.
        workload = build_workload(trace, sessions, None, time_scale, token_scale, 0)
    except (AgentKVError, ValueError) as exc:
        fail(str(exc))
    spec = protocol.RowSpec(
        predict_row,
        str(trace) if trace is not None else None,
        token_scale if token_scale is not None else (1.0 if trace else BENCH_TOKEN_SCALE),
        time_scale if time_scale is not None else (1.0 if trace else WorkloadConfig.time_scale),
        num_blocks,
        host_capacity_gib,
        str(calibration) if calibration is not None else None,
        sessions,
    )
    pred = protocol.predict(spec, workload, costs)
    path = protocol.PREDICTIONS_DIR / f"{predict_row}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(pred, indent=1) + "\n", encoding="utf-8")
    if as_json:
        typer.echo(json.dumps({"path": str(path), **pred}))
        return
    typer.echo(
        f"prediction written to {path} (held out: {pred['held_out']}); now\n"
        f"  git add -f {path} && git commit -m 'prediction {predict_row}'\n"
        f"then measure:\n  {pred['command']}\nthen: agentkv simulate validate"
    )


def fit_builtin_cmd(
    measured: Path = typer.Argument(
        ...,
        exists=True,
        dir_okay=False,
        help="The measured bench run (tests/unit/fixtures/simulate/bench_agents_small_cpu.json).",
    ),
    top: int = typer.Option(5, "--top", min=1, help="Grid points to print, best first."),
) -> None:
    """Re-derive the built-in calibration's FLOP rate and step overhead: the grid point that
    reproduces MEASURED best (``agentkv.simulate.grid_fit``; docs/simulate.md, "The built-in
    calibration")."""
    from agentkv.errors import AgentKVError
    from agentkv.policy import Writeback
    from agentkv.simulate.costs import BENCH_SMALL_CPU
    from agentkv.simulate.fleet import FleetConfig
    from agentkv.simulate.grid_fit import grid_fit
    from agentkv.simulate.validate import load_measured
    from agentkv_bench.workload import WorkloadConfig

    try:
        data = load_measured(measured)
        setup = data["setup"]
        workload = bench_workload(WorkloadConfig(**setup["workload"]))
        fleet = FleetConfig(
            num_blocks=setup["num_blocks"],
            host_capacity_gib=setup["host_capacity_gib"],
            writeback=Writeback(setup.get("writeback", "eager")),
        )
        points = grid_fit(workload, data["configs"], BENCH_SMALL_CPU, fleet)
    except (AgentKVError, KeyError, TypeError, ValueError) as exc:
        fail(f"{measured}: not a measured bench run with its setup ({exc})")
    typer.echo("| FLOP rate | step overhead | largest error | on |\n|---:|---:|---:|---|")
    for p in points[:top]:
        w = p.worst
        typer.echo(
            f"| {p.prefill_flops_per_s / 1e11:.1f}e11 | {p.step_overhead_s * 1e3:.0f} ms "
            f"| {p.max_error:.1%} | {w.config} {w.metric} |"
        )
    best, b = points[0], BENCH_SMALL_CPU
    same = (b.prefill_flops_per_s, b.step_overhead_s) == (
        best.prefill_flops_per_s,
        best.step_overhead_s,
    )
    typer.echo(
        f"fit: prefill_flops_per_s={best.prefill_flops_per_s / 1e11:.1f}e11 "
        f"step_overhead_s={best.step_overhead_s:g} ("
        + (
            "the built-in constants"
            if same
            else f"the built-in has {b.prefill_flops_per_s / 1e11:.2f}e11, {b.step_overhead_s:g}"
        )
        + ")"
    )
