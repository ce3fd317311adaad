"""``agentkv simulate``: a fleet simulation calibrated on this engine, and a capacity search.

Only typer is imported at module level. The simulator (``agentkv.simulate``) takes a neutral
workload; simulate_workload.py adapts the two sources to it (the generator of ``agentkv bench
agents`` and recorded traces). The options are in simulate_options.py, the tables in
simulate_report.py, ``simulate validate``, ``simulate fit-builtin`` and ``calibrate --load`` in
simulate_validate.py.

Primitives:
    simulate_cmd   the command: checks the options, builds the engine costs and the workload,
                   then runs every router x policy (or searches the smallest fleet) and prints.
    register       adds ``simulate``, ``simulate validate`` and ``simulate fit-builtin`` to the
                   root app.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from agentkv.cli import simulate_options as opts
from agentkv.cli import simulate_report as report
from agentkv.cli.common import fail, with_progress
from agentkv.cli.simulate_validate import fit_builtin_cmd, validate_cmd
from agentkv.cli.simulate_workload import build_workload

if TYPE_CHECKING:
    from agentkv.simulate.costs import EngineCosts
    from agentkv.simulate.fleet import FleetConfig, SimResult
    from agentkv.simulate.load import OfferedLoad
    from agentkv.simulate.workload import SimWorkload


@dataclass(frozen=True, slots=True)
class SimulateArgs:
    """The command's options, one field per parameter of ``simulate_cmd`` (same names)."""

    trajectories: int | None
    turns: int | None
    fork_prob: float | None
    fork_width: int | None
    trace: Path | None
    sessions: int | None
    time_scale: float | None
    token_scale: float | None
    seed: int
    num_blocks: int | None
    gpu: str | None
    model_name: str
    tp: int
    host_capacity_gib: float
    disk_capacity_gib: float
    remote_capacity_gib: float
    replicas: int
    router: str
    policy: str
    mu: float
    gamma: float
    retain_ttl_s: float
    calibration: Path | None
    rate: float | None
    find: bool
    slo_ttft_p99: float | None
    max_replicas: int
    compare_with: Path | None
    admission: str
    writeback: str
    grace_s: float | None
    pause_after: str
    device_prefetch: bool
    full: bool
    plot: Path | None
    as_json: bool


def simulate_cmd(
    ctx: typer.Context,
    trajectories: opts.Trajectories = None,
    turns: opts.Turns = None,
    fork_prob: opts.ForkProb = None,
    fork_width: opts.ForkWidth = None,
    trace: opts.Trace = None,
    sessions: opts.Sessions = None,
    time_scale: opts.TimeScale = None,
    token_scale: opts.TokenScale = None,
    seed: opts.Seed = 0,
    num_blocks: opts.NumBlocks = None,
    gpu: opts.Gpu = None,
    model_name: opts.ModelName = "llama-3.1-8b",
    tp: opts.Tp = 1,
    host_capacity_gib: opts.HostCapacityGib = 2.0,
    disk_capacity_gib: opts.DiskCapacityGib = 0.0,
    remote_capacity_gib: opts.RemoteCapacityGib = 0.0,
    replicas: opts.Replicas = 1,
    router: opts.Router = "session-affinity",
    policy: opts.Policy = "vanilla,agentkv",
    mu: opts.Mu = 0.5,
    gamma: opts.Gamma = 2.0,
    retain_ttl_s: opts.RetainTtlS = 60.0,
    calibration: opts.Calibration = None,
    rate: opts.Rate = None,
    find: opts.Find = False,
    slo_ttft_p99: opts.SloTtftP99 = None,
    max_replicas: opts.MaxReplicas = 64,
    compare_with: opts.CompareWith = None,
    admission: opts.Admission = "whole",
    writeback: opts.WritebackMode = "forecast",
    grace_s: opts.GraceS = None,
    pause_after: opts.PauseAfter = "0",
    device_prefetch: opts.DevicePrefetch = False,
    full: opts.Full = False,
    plot: opts.Plot = None,
    as_json: opts.AsJson = False,
) -> None:
    """Simulate a fleet of vLLM replicas with agentkv (or another KV policy) behind a router.

    A discrete-event simulation (SimPy) of N replicas, each a paged KV pool (blocks of the
    engine's size, prefix sharing, LRU eviction like vLLM), a prefill/decode step cost model
    calibrated on the engine, host, disk and remote tiers with their bandwidths, and agentkv's
    own policy and predictor deciding every pause. Reports TTFT p50/p99 (all and resume
    turns), job completion time, hit rate, tokens recomputed, KV occupancy over time and
    demotions. With --find-replicas --rate R --slo-ttft-p99 X it answers the smallest fleet.
    """
    if ctx.invoked_subcommand is not None:
        return
    # Every parameter but ctx, by name: a parameter without its field fails at once (TypeError).
    args = {name: value for name, value in locals().items() if name != "ctx"}
    _simulate(SimulateArgs(**args))


def _split(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    names = list(allowed) if value == "all" else [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        fail(f"unknown {what} {', '.join(bad) or value!r}; choose from: {', '.join(allowed)}, all")
    return names


def _check(a: SimulateArgs) -> tuple[list[str], list[str]]:
    """The routers and policies asked for; exits with a message for a bad combination."""
    from agentkv.policy import Writeback
    from agentkv.simulate.admission import Admission
    from agentkv.simulate.policies import POLICIES
    from agentkv.simulate.routers import ROUTERS

    routers = _split(a.router, ROUTERS, "router")
    if a.admission not in {x.value for x in Admission}:
        fail(f"unknown --admission {a.admission!r}; choose from: whole, chunk")
    if a.writeback not in {x.value for x in Writeback}:
        fail(f"unknown --writeback {a.writeback!r}; choose from: {', '.join(Writeback)}")
    _pause_after(a.pause_after)
    policies = _split(a.policy, POLICIES, "policy")
    if a.trace is not None and (a.fork_prob is not None or a.fork_width is not None):
        fail("--fork-prob and --fork-width shape the bench workload; traces carry no forks")
    if a.find and (a.rate is None or a.slo_ttft_p99 is None):
        fail("--find-replicas needs --rate and --slo-ttft-p99")
    if a.gpu is not None and a.calibration is not None:
        fail("--gpu and --calibration are exclusive")
    return routers, policies


def _pause_after(value: str) -> float | None:
    """--pause-after: seconds >= 0, or 'never' (None)."""
    if value.strip().lower() == "never":
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        fail(f"--pause-after takes seconds >= 0 or 'never', not {value!r}")
    return seconds


def _inputs(a: SimulateArgs) -> tuple[EngineCosts, int, SimWorkload]:
    """The engine costs (--gpu, --calibration or the bench's engine), the pool size and the
    workload (arrivals made Poisson with --rate); prints the calibration's notes."""
    from rich.console import Console

    from agentkv.errors import AgentKVError
    from agentkv.simulate.costs import BENCH_SMALL_CPU, load_calibration

    num_blocks = a.num_blocks
    try:
        if a.gpu is not None:
            from agentkv.hardware import get_preset
            from agentkv.simulate.presets import get_model, gpu_costs, gpu_num_blocks

            costs = gpu_costs(a.gpu, a.model_name, a.tp)
            if num_blocks is None:
                num_blocks = gpu_num_blocks(get_preset(a.gpu), get_model(a.model_name), a.tp)
        else:
            costs = (
                load_calibration(a.calibration) if a.calibration is not None else BENCH_SMALL_CPU
            )
        if num_blocks is None:
            num_blocks = 128
        workload = build_workload(
            a.trace,
            a.sessions or a.trajectories,
            a.turns,
            a.time_scale,
            a.token_scale,
            a.seed,
            a.fork_prob,
            a.fork_width,
        )
    except (AgentKVError, ValueError) as exc:
        fail(str(exc))
    err = Console(stderr=True)
    for note in costs.notes:
        err.print(f"[yellow]calibration:[/] {note}", soft_wrap=True)
    if a.rate is not None:
        if a.rate <= 0:
            fail("--rate must be positive")
        workload = workload.with_poisson_arrivals(a.rate, a.seed)
    return costs, num_blocks, workload


def _simulate(a: SimulateArgs) -> None:
    from rich.console import Console

    from agentkv.policy import Writeback
    from agentkv.simulate.admission import Admission
    from agentkv.simulate.fleet import FleetConfig
    from agentkv.simulate.load import offered_load

    routers, policies = _check(a)
    costs, num_blocks, workload = _inputs(a)
    base = FleetConfig(
        replicas=a.replicas,
        num_blocks=num_blocks,
        host_capacity_gib=a.host_capacity_gib,
        disk_capacity_gib=a.disk_capacity_gib,
        remote_capacity_gib=a.remote_capacity_gib,
        mu=a.mu,
        gamma=a.gamma,
        retain_ttl_s=a.retain_ttl_s,
        costs=costs,
        admission=Admission(a.admission),
        writeback=Writeback(a.writeback),
        pause_after_s=_pause_after(a.pause_after),
        device_prefetch=a.device_prefetch,
    )
    if a.grace_s is not None:
        base = replace(base, grace_s=a.grace_s)
    combos = [(r, p) for r in routers for p in policies]
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # pipes and logs get the whole table, not wrapped cells
    if a.find:
        assert a.slo_ttft_p99 is not None
        _search(workload, base, combos, a, console)
        return
    load = offered_load(workload, costs, num_blocks, a.replicas)
    if not a.full:
        base = replace(base, horizon_s=load.horizon_s())
    warning = load.warning()
    if warning:
        Console(stderr=True).print(f"[bold red]warning:[/] {warning}", soft_wrap=True)
    results = _run_all(workload, base, combos, load)
    measured_rows = _compare(a.compare_with, results)
    plots = []
    if a.plot is not None:
        from agentkv.simulate.plots import plot_results

        plots = [str(p) for p in plot_results(results, a.plot)]
    if a.as_json:
        typer.echo(json.dumps(_json(workload, costs, load, results, measured_rows, plots)))
        return
    console.print(
        f"{workload.name}: {len(workload.trajectories)} trajectories, {workload.turns} turns; "
        f"{a.replicas} replica(s) of {num_blocks} blocks, host {a.host_capacity_gib:g} GiB; "
        f"engine {costs.name} ({costs.provenance})"
    )
    console.print(report.results_table(results))
    if measured_rows:
        console.print(report.compare_table(measured_rows, costs))
    walls = ", ".join(f"{v.wall_s:.2f} s" for v in results.values())
    Console(stderr=True).print(
        f"simulated in {walls}" + (f"; plots: {', '.join(plots)}" if plots else "")
    )


def _run_all(
    workload: SimWorkload,
    base: FleetConfig,
    combos: list[tuple[str, str]],
    load: OfferedLoad,
) -> dict[str, SimResult]:
    """Simulate every router/policy pair, with a progress bar; keyed "router/policy"."""
    from agentkv.simulate.fleet import simulate

    def run_all(on_progress: Any) -> dict[str, SimResult]:
        out: dict[str, SimResult] = {}
        for r, p in combos:
            label = f"{r}/{p}"

            def step(phase: str, done: int, total: int, label: str = label) -> None:
                on_progress(f"{label}: {phase}", done, total)

            out[label] = simulate(workload, replace(base, router=r, policy=p), step, load)
        return out

    return with_progress(run_all)


def _compare(compare_with: Path | None, results: dict[str, SimResult]) -> list[Any] | None:
    """Simulated vs measured rows for --compare (None without it)."""
    if compare_with is None:
        return None
    from agentkv.errors import AgentKVError
    from agentkv.simulate.validate import compare, load_measured

    try:
        measured = load_measured(compare_with)
    except AgentKVError as exc:
        fail(str(exc))
    by_policy = {k.split("/", 1)[1]: v.summary.to_dict() for k, v in results.items()}
    return compare(by_policy, measured["configs"])


def _json(
    workload: SimWorkload,
    costs: EngineCosts,
    load: OfferedLoad,
    results: dict[str, SimResult],
    measured_rows: list[Any] | None,
    plots: list[str],
) -> dict[str, Any]:
    return {
        "workload": {
            "name": workload.name,
            "trajectories": len(workload.trajectories),
            "turns": workload.turns,
        },
        "costs": costs.to_dict(),
        "load": load.to_dict(),
        "results": {k: v.to_dict(with_samples=True) for k, v in results.items()},
        "compare": [r.to_dict() for r in measured_rows] if measured_rows else None,
        "plots": plots,
    }


def _search(
    workload: SimWorkload,
    base: FleetConfig,
    combos: list[tuple[str, str]],
    a: SimulateArgs,
    console: Any,
) -> None:
    from agentkv.simulate.search import find_replicas

    slo = a.slo_ttft_p99
    assert slo is not None

    def run_all(on_progress: Any) -> list[Any]:
        return [
            find_replicas(
                workload, replace(base, router=r, policy=p), slo, a.max_replicas, on_progress
            )
            for r, p in combos
        ]

    found = with_progress(run_all)
    if a.plot is not None:
        from agentkv.simulate.plots import plot_results

        plot_results({f"{f.router}/{f.policy}": f.result for f in found if f.result}, a.plot)
    if a.as_json:
        typer.echo(
            json.dumps(
                {
                    "rate_per_s": a.rate,
                    "slo_ttft_p99_s": slo,
                    "results": [f.to_dict() for f in found],
                }
            )
        )
        return
    console.print(report.search_table(found, slo, a.rate, a.max_replicas))


def register(app: typer.Typer) -> None:
    """Add ``simulate`` (and ``simulate validate``, ``simulate fit-builtin``) to the root app."""
    sim = typer.Typer(
        invoke_without_command=True,
        help="Simulate a fleet of vLLM replicas with agentkv behind a router.",
    )
    sim.callback()(simulate_cmd)
    sim.command("validate")(validate_cmd)
    sim.command("fit-builtin")(fit_builtin_cmd)
    app.add_typer(sim, name="simulate")
