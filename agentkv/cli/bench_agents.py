"""``agentkv bench agents``: an agent workload with tool waits, vanilla vLLM vs vLLM + agentkv.

With ``--trace FILE`` it replays a recorded workload (TraceLab CSV or JSONL, ``agentkv.traces``)
instead, on vanilla vLLM, agentkv and an oracle (``agentkv_bench.trace_runner``).

Only typer is imported at module level; the benchmark (``agentkv_bench``) and its dependencies
load inside the command, so ``agentkv --help`` stays fast.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from agentkv.cli.common import fail, with_progress

if TYPE_CHECKING:
    from agentkv_bench.matrix import BenchConfig


def agents(
    preset: str | None = typer.Option(
        None, "--preset", help="Embedded model: small (default; recompute is expensive) or tiny."
    ),
    trajectories: int | None = typer.Option(
        None, "--trajectories", "-n", min=1, help="Concurrent trajectories (default 6)."
    ),
    turns: int | None = typer.Option(
        None, "--turns", "-t", min=1, help="Turns per trajectory (default 5)."
    ),
    time_scale: float | None = typer.Option(
        None,
        "--time-scale",
        min=0.0,
        help="Multiplies every tool wait (compile ~3 s, test suite ~30 s, human approval ~180 s "
        "medians) and the start stagger. Default 0.1. With --trace: multiplies the trace's "
        "arrival times and tool waits (default 1).",
    ),
    trace: Path | None = typer.Option(
        None,
        "--trace",
        exists=True,
        dir_okay=False,
        readable=True,
        help="Replay this recorded workload instead of the generated one: TraceLab session CSV "
        "(session_id,arrival_time,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms), "
        "its canonical form (id,input_len,...,prefix_len) or round-trace JSONL (.gz read too); "
        "the format is detected. A closed loop per session (send a round, read the whole reply, "
        "wait tool_wait_after_ms, send the next), prompts as token ids whose prefix is the "
        "session's history. Runs vanilla vLLM, agentkv and an oracle (vanilla with enough "
        "blocks that nothing is evicted) and takes each resume stall apart.",
    ),
    token_scale: float = typer.Option(
        1.0,
        "--token-scale",
        min=0.0001,
        help="With --trace: multiplies every prefix, input and output length (fit the machine).",
    ),
    sessions: int | None = typer.Option(
        None, "--sessions", min=1, help="With --trace: replay only the first N sessions."
    ),
    seed: int = typer.Option(0, "--seed", help="Workload seed: same seed, same workload."),
    fork_prob: float | None = typer.Option(
        None, "--fork-prob", min=0.0, max=1.0, help="Chance that a turn forks into 2 branches."
    ),
    num_blocks: str | None = typer.Option(
        None,
        "--num-blocks",
        help="Device KV blocks (128 tokens each), the same for every configuration but the "
        "oracle; small enough that paused trajectories do not all fit (default 128). With "
        "--trace: default a quarter of the oracle's, at least two of the longest context. A "
        "comma-separated list (e.g. 96,48,24: roomy, tight, very tight) sweeps the pool size: "
        "each size is a full run of every configuration, reported side by side in sweep.md.",
    ),
    configs: str | None = typer.Option(
        None,
        "--configs",
        help="Configurations to run, comma-separated, in this order: vanilla, agentkv, "
        "retain-always and offload-always (the agentkv connector taking that one action at "
        "every pause: fixed policies), oracle (vanilla vLLM with a pool that never evicts, run "
        "once). Default vanilla,agentkv (with --trace vanilla,agentkv,oracle). Given, or with "
        "several --num-blocks, the run is a sweep: sweep.md gives every metric per configuration "
        "and pool size and agentkv's regret against the best fixed policy.",
    ),
    host_capacity_gib: float = typer.Option(
        2.0, "--host-capacity-gib", min=0.1, help="agentkv host tier size."
    ),
    disk: bool = typer.Option(
        False,
        "--disk",
        help="agentkv configurations offload every pause to the disk tier (a reload is a disk "
        "read, so what device prefetch saves shows on CPU too).",
    ),
    prefetch: bool = typer.Option(
        True,
        "--prefetch/--no-prefetch",
        help="Device prefetch in the agentkv configurations (docs/prefetch.md): the report's "
        "prefetch section gives its on-time rate and the TTFT of on-time resumes against the "
        "oracle's device hits on the same turns (add oracle to --configs).",
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Folder for report.json, report.md, PNGs, logs (default bench/results/agents, "
        "with --trace bench/results/trace).",
    ),
    quick: bool = typer.Option(
        False,
        "--quick",
        help="CI smoke run: tiny model, 3 trajectories x 3 turns, sub-second waits, no "
        "overhead benchmark. Checks completion and a well-formed report, not the targets. "
        "With --trace: the tiny model (the trace's sizes as given).",
    ),
    skip_overhead: bool = typer.Option(
        False, "--skip-overhead", help="Skip the no-pause overhead run (`vllm bench serve`)."
    ),
    overhead: bool = typer.Option(
        False, "--overhead", help="Run the overhead benchmark even with --quick."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print the summary and targets as JSON on stdout."
    ),
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
    """
    from rich.console import Console

    argv_tail = sys.argv[sys.argv.index("agents") + 1 :] if "agents" in sys.argv else []
    if trace is not None:
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
        _trace(
            trace,
            configs=configs,
            token_scale=token_scale,
            time_scale=1.0 if time_scale is None else time_scale,
            sessions=sessions,
            seed=seed,
            preset=preset or ("tiny" if quick else "small"),
            num_blocks=num_blocks,
            host_capacity_gib=host_capacity_gib,
            out=out or Path("bench/results/trace"),
            as_json=as_json,
            disk=disk,
            prefetch=prefetch,
            command="agentkv bench agents " + shlex.join(argv_tail),
        )
        return
    out = out or Path("bench/results/agents")
    from agentkv.errors import AgentKVError
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
        overhead=None if skip_overhead or (quick and not overhead) else OverheadSpec(),
        command="agentkv bench agents " + shlex.join(sys.argv[sys.argv.index("agents") + 1 :])
        if "agents" in sys.argv
        else "agentkv bench agents",
    )
    if config_list is not None:
        opts.configs = tuple(c.value for c in config_list)
    # vLLM refuses a max length whose KV would not fit in the blocks (it keeps one in reserve);
    # a sweep gives every pool size the smallest's, so configurations differ only in the pool.
    opts.max_model_len = min(4096 if quick else 16384, (min(pools or [opts.num_blocks]) - 1) * 128)
    if quick and opts.overhead is not None:
        opts.overhead = OverheadSpec(num_prompts=8, input_len=256, output_len=16, num_warmups=1)
    if config_list is not None or len(pools or ()) > 1:
        from agentkv_bench.sweep_runner import run_agents_sweep

        try:
            sweep = with_progress(
                lambda on_progress: run_agents_sweep(opts, pools or [opts.num_blocks], on_progress)
            )
        except AgentKVError as exc:
            fail(str(exc))
        _show_sweep(sweep, out, as_json)
        return
    try:
        report = with_progress(lambda on_progress: run_bench(opts, on_progress))
    except AgentKVError as exc:
        fail(str(exc))
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
    from rich.markdown import Markdown

    Console().print(Markdown((out / "report.md").read_text()))
    Console(stderr=True).print(
        f"report: {out / 'report.json'}, {out / 'report.md'}, plots: {out}/*.png"
    )


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
    Console(stderr=True).print(
        f"sweep: {out / 'sweep.json'}, {out / 'sweep.md'}; each pool size's report: {out}/pool-*/"
    )


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
) -> None:
    from rich.console import Console

    from agentkv.errors import AgentKVError
    from agentkv_bench.trace_runner import TraceBenchOptions, plan, run_trace_bench

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
    )
    if config_list is not None:
        opts.configs = tuple(c.value for c in config_list)
    if config_list is not None or len(pools or ()) > 1:
        from agentkv_bench.sweep_runner import run_trace_sweep

        try:
            sizes = list(pools) if pools else [plan(opts)[2].num_blocks]
            sweep = with_progress(lambda on_progress: run_trace_sweep(opts, sizes, on_progress))
        except AgentKVError as exc:
            fail(str(exc))
        _show_sweep(sweep, out, as_json)
        return
    try:
        report = with_progress(lambda on_progress: run_trace_bench(opts, on_progress))
    except AgentKVError as exc:
        fail(str(exc))
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
    Console(stderr=True).print(
        f"report: {out / 'report.json'}, {out / 'report.md'}, plots: {out}/trace_*.png"
    )


def register(app: typer.Typer) -> None:
    """Add ``agents`` to the ``bench`` sub-app."""
    app.command("agents")(agents)
