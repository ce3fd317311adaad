"""``agentkv bench agents``: an agent workload with tool waits, vanilla vLLM vs vLLM + agentkv.

With ``--trace FILE`` it replays a recorded workload (TraceLab CSV or JSONL, ``agentkv.traces``)
instead, on vanilla vLLM, agentkv and an oracle (``agentkv_bench.trace_runner``).

Only typer is imported at module level; the benchmark (``agentkv_bench``) and its dependencies
load inside the command, so ``agentkv --help`` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from agentkv.cli import bench_agents_options as options
from agentkv.cli.bench_common import bench_command, print_paths, run_or_fail
from agentkv.cli.common import fail

if TYPE_CHECKING:
    from agentkv_bench.drivers import PauseVia
    from agentkv_bench.matrix import BenchConfig


def agents(
    preset: options.Preset = None,
    trajectories: options.Trajectories = None,
    turns: options.Turns = None,
    time_scale: options.TimeScale = None,
    trace: options.Trace = None,
    token_scale: options.TokenScale = 1.0,
    sessions: options.Sessions = None,
    seed: options.Seed = 0,
    fork_prob: options.ForkProb = None,
    num_blocks: options.NumBlocks = None,
    configs: options.Configs = None,
    repeats: options.Repeats = 1,
    host_capacity_gib: options.HostCapacityGib = 2.0,
    disk: options.Disk = False,
    prefetch: options.Prefetch = True,
    pause_via: options.PauseViaOpt = "routes",
    out: options.Out = None,
    quick: options.Quick = False,
    skip_overhead: options.SkipOverhead = False,
    overhead: options.Overhead = False,
    as_json: options.AsJson = False,
) -> None:
    """Run the same seeded agent workload against vanilla vLLM (prefix caching) and vLLM with
    agentkv (same model, same KV blocks), one after the other, and compare them.

    Reports resume TTFT p50/p99 (first turn after a tool wait), TTFT of all turns, job
    completion time, tokens recomputed, prefix hit rate, decode throughput and KV held over
    time, with agentkv/vanilla ratios, as report.json, report.md and PNG plots in --out. Also
    runs `vllm bench serve` on both servers for the overhead without pauses. vLLM's native
    offloading and LMCache need CUDA and are skipped on CPU.

    With --trace FILE: replays a recorded agent workload on vanilla vLLM, agentkv and an
    oracle (vanilla vLLM with a pool so large nothing is evicted), reports agentkv/vanilla and
    agentkv/oracle for resume TTFT and job completion time, and takes each resume stall apart
    (KV load per tier, prefill, queueing) next to a raw memcpy of the same bytes. Example:
    agentkv bench agents --trace multi_session_large.csv --token-scale 0.5 --num-blocks 160

    --configs, several --num-blocks or --repeats N > 1 make the run a sweep (sweep.md).
    """
    if trace is not None:
        _reject_generator_flags(
            trajectories=trajectories, turns=turns, fork_prob=fork_prob, overhead=overhead
        )
        _trace(
            trace,
            configs=configs,
            repeats=repeats,
            token_scale=token_scale,
            time_scale=1.0 if time_scale is None else time_scale,
            sessions=sessions,
            seed=seed,
            preset=preset or ("tiny" if quick else "small"),
            num_blocks=num_blocks,
            host_capacity_gib=host_capacity_gib,
            out=out or Path("bench/results/trace"),
            as_json=as_json,
            command=bench_command("agents"),
            disk=disk,
            prefetch=prefetch,
            pause_via=pause_via,
        )
        return
    _synthetic(
        preset=preset,
        trajectories=trajectories,
        turns=turns,
        time_scale=time_scale,
        seed=seed,
        fork_prob=fork_prob,
        num_blocks=num_blocks,
        configs=configs,
        repeats=repeats,
        host_capacity_gib=host_capacity_gib,
        out=out or Path("bench/results/agents"),
        quick=quick,
        skip_overhead=skip_overhead,
        overhead=overhead,
        as_json=as_json,
        disk=disk,
        prefetch=prefetch,
        pause_via=pause_via,
    )


def _pause_via(value: str) -> PauseVia:
    """--pause-via as the drivers' enum, or a clear error naming the choices."""
    from agentkv_bench.drivers import PauseVia

    try:
        return PauseVia(value)
    except ValueError:
        fail(f"--pause-via must be one of {', '.join(v.value for v in PauseVia)}, got {value!r}")


def _reject_generator_flags(
    *, trajectories: int | None, turns: int | None, fork_prob: float | None, overhead: bool
) -> None:
    """Fail when a flag that shapes the generated workload comes with --trace."""
    clash = [
        flag
        for flag, given in (
            ("--trajectories", trajectories is not None),
            ("--turns", turns is not None),
            ("--fork-prob", fork_prob is not None),
            ("--overhead", overhead),
        )
        if given
    ]
    if clash:
        fail(f"{', '.join(clash)} shape the generated workload; they do not apply with --trace")


def _synthetic(
    *,
    preset: str | None,
    trajectories: int | None,
    turns: int | None,
    time_scale: float | None,
    seed: int,
    fork_prob: float | None,
    num_blocks: str | None,
    configs: str | None,
    host_capacity_gib: float,
    out: Path,
    quick: bool,
    skip_overhead: bool,
    overhead: bool,
    as_json: bool,
    disk: bool = False,
    prefetch: bool = True,
    repeats: int = 1,
    pause_via: str = "routes",
) -> None:
    """The generated workload: one run of every configuration, or a sweep (pool sizes, an
    explicit --configs list, or --repeats)."""
    from agentkv_bench.matrix import BenchConfig

    config_list, pools = _matrix(configs, num_blocks)
    if config_list is not None and BenchConfig.VANILLA not in config_list:
        fail(
            "--configs must include vanilla for the synthetic workload (its report is read "
            "against vanilla)"
        )
    from agentkv_bench.overhead import OverheadSpec
    from agentkv_bench.runner import BenchOptions, run_bench
    from agentkv_bench.workload import WorkloadConfig

    base = WorkloadConfig.quick(seed) if quick else WorkloadConfig(seed=seed)
    try:
        cfg = base.with_overrides(
            trajectories=trajectories, turns=turns, time_scale=time_scale, fork_prob=fork_prob
        )
    except ValueError as exc:
        fail(str(exc))
    opts = BenchOptions(
        workload=cfg,
        preset=preset or ("tiny" if quick else "small"),
        num_blocks=pools[0] if pools else (48 if quick else 128),
        host_capacity_gib=host_capacity_gib,
        max_model_len=0,
        out=out,
        disk=disk,
        prefetch=prefetch,
        pause_via=_pause_via(pause_via),
        overhead=None if skip_overhead or (quick and not overhead) else OverheadSpec(),
        command=bench_command("agents"),
    )
    if config_list is not None:
        opts.configs = tuple(c.value for c in config_list)
    # vLLM refuses a max length whose KV would not fit in the blocks (it keeps one in reserve);
    # a sweep gives every pool size the smallest's, so configurations differ only in the pool.
    opts.max_model_len = min(4096 if quick else 16384, (min(pools or [opts.num_blocks]) - 1) * 128)
    if quick and opts.overhead is not None:
        opts.overhead = OverheadSpec(num_prompts=8, input_len=256, output_len=16, num_warmups=1)
    if config_list is not None or len(pools or ()) > 1 or repeats > 1:
        from agentkv_bench.sweep_runner import run_agents_sweep

        sweep = run_or_fail(
            lambda on_progress: run_agents_sweep(
                opts, pools or [opts.num_blocks], on_progress, repeats=repeats
            )
        )
        _show_sweep(sweep, out, as_json)
        return
    report = run_or_fail(lambda on_progress: run_bench(opts, on_progress))
    _show_report(report, out, as_json)


def _show_report(report: dict[str, Any], out: Path, as_json: bool) -> None:
    """The summary and targets as JSON, or report.md and where the report and plots are."""
    summary = {
        "out": str(out),
        "summaries": {k: v["summary"] for k, v in report["configs"].items()},
        "ratios_agentkv_over_vanilla": report["ratios_agentkv_over_vanilla"],
        "targets": report["targets"],
        "overhead": {
            k: v
            for k, v in report["overhead"].items()
            if k in ("status", "throughput_loss_pct", "reason")
        },
        "native_offload": report["native_offload"],
        "connector_cpu": report["connector_cpu"],
    }
    if as_json:
        typer.echo(json.dumps(summary))
        return
    from rich.console import Console
    from rich.markdown import Markdown

    Console().print(Markdown((out / "report.md").read_text()))
    print_paths(f"report: {out / 'report.json'}, {out / 'report.md'}, plots: {out}/*.png")


def _matrix(
    configs: str | None, num_blocks: str | None
) -> tuple[tuple[BenchConfig, ...] | None, tuple[int, ...] | None]:
    """--configs and --num-blocks parsed (None where not given); a bad value fails the command."""
    from agentkv_bench.matrix import parse_configs, parse_num_blocks

    try:
        return (
            parse_configs(configs) if configs is not None else None,
            parse_num_blocks(num_blocks) if num_blocks is not None else None,
        )
    except ValueError as exc:
        fail(str(exc))


def _show_sweep(sweep: dict[str, Any], out: Path, as_json: bool) -> None:
    if as_json:
        typer.echo(
            json.dumps({"out": str(out), **{k: v for k, v in sweep.items() if k != "machine"}})
        )
        return
    from rich.console import Console
    from rich.markdown import Markdown

    Console().print(Markdown((out / "sweep.md").read_text()))
    each = f"{out}/pool-*/rep-*/" if sweep.get("repeats") else f"{out}/pool-*/"
    print_paths(f"sweep: {out / 'sweep.json'}, {out / 'sweep.md'}; each pool size's report: {each}")


def _trace(
    trace: Path,
    *,
    configs: str | None,
    token_scale: float,
    time_scale: float,
    sessions: int | None,
    seed: int,
    preset: str,
    num_blocks: str | None,
    host_capacity_gib: float,
    out: Path,
    as_json: bool,
    command: str,
    disk: bool = False,
    prefetch: bool = True,
    repeats: int = 1,
    pause_via: str = "routes",
) -> None:
    from rich.console import Console

    from agentkv.errors import AgentKVError
    from agentkv_bench.trace_runner import TraceBenchOptions, plan, run_trace_bench

    via = _pause_via(pause_via)
    config_list, pools = _matrix(configs, num_blocks)
    opts = TraceBenchOptions(
        trace=trace,
        token_scale=token_scale,
        time_scale=time_scale,
        sessions=sessions,
        seed=seed,
        preset=preset,
        num_blocks=pools[0] if pools else None,
        host_capacity_gib=host_capacity_gib,
        out=out,
        command=command,
        disk=disk,
        prefetch=prefetch,
        pause_via=via,
    )
    if config_list is not None:
        opts.configs = tuple(c.value for c in config_list)
    if config_list is not None or len(pools or ()) > 1 or repeats > 1:
        from agentkv_bench.sweep_runner import run_trace_sweep

        try:
            sizes = list(pools) if pools else [plan(opts)[2].num_blocks]
        except AgentKVError as exc:
            fail(str(exc))
        sweep = run_or_fail(
            lambda on_progress: run_trace_sweep(opts, sizes, on_progress, repeats=repeats)
        )
        _show_sweep(sweep, out, as_json)
        return
    report = run_or_fail(lambda on_progress: run_trace_bench(opts, on_progress))
    if as_json:
        summary = {
            "out": str(out),
            "summaries": {k: v["summary"] for k, v in report["configs"].items()},
            **{k: v for k, v in report.items() if k.startswith("ratios_")},
            "oracle_check": report.get("oracle_check"),
            "stall_decomposition": report["stall_decomposition"],
        }
        typer.echo(json.dumps(summary))
        return
    from rich.markdown import Markdown

    Console().print(Markdown((out / "report.md").read_text()))
    print_paths(f"report: {out / 'report.json'}, {out / 'report.md'}, plots: {out}/trace_*.png")


def register(app: typer.Typer) -> None:
    """Add ``agents`` to the ``bench`` sub-app."""
    app.command("agents")(agents)
