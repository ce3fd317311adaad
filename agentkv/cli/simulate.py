"""``agentkv simulate``: a fleet simulation calibrated on this engine, and a capacity search.

Only typer is imported at module level. The simulator (``agentkv.simulate``) takes a neutral
workload; this module adapts the two sources to it: the generator of ``agentkv bench agents``
(``agentkv_bench.workload``, imported inside the command) and recorded traces
(``agentkv.traces``, the same formats as ``bench agents --trace``).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from agentkv.cli.common import fail, with_progress

if TYPE_CHECKING:
    from agentkv.simulate.fleet import SimResult
    from agentkv.simulate.workload import SimWorkload
    from agentkv_bench.workload import WorkloadConfig

# Prompt tokens per generator target token in the bench: the embedded tokenizer's real rate on
# the generator's words plus the chat template. From the README's Performance table: 123,079
# tokens recomputed at a 0.282 hit rate (vanilla) and 32,967 at 0.808 (agentkv) are both
# ~171,500 prompt tokens, where the plan's targets add up to 152,391.
BENCH_TOKEN_SCALE = 1.125
# Above this many turns the bench plan is drawn without its text (same distributions and seeds
# per trajectory, but not the exact numbers of `agentkv bench agents`, which also draws words).
EXACT_PLAN_MAX_TURNS = 3000

# Rows that mean nothing when a horizon cut an unbounded overload short (queues still growing).
LATENCY_ROWS = frozenset(
    {
        "resume_ttft_p50_s",
        "resume_ttft_p99_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "jct_mean_s",
        "makespan_s",
    }
)

SHOWN: tuple[tuple[str, str], ...] = (
    ("resume_ttft_p50_s", "resume TTFT p50 (s)"),
    ("resume_ttft_p99_s", "resume TTFT p99 (s)"),
    ("ttft_p50_s", "TTFT p50, all turns (s)"),
    ("ttft_p99_s", "TTFT p99, all turns (s)"),
    ("jct_mean_s", "job completion time, mean (s)"),
    ("recomputed_tokens", "tokens recomputed"),
    ("prefix_hit_rate", "prefix hit rate, all turns"),
    ("resume_hit_rate", "prefix hit rate, resume turns"),
    ("tier_hit_tokens", "tokens loaded from tiers"),
    ("decode_tok_s", "decode throughput per sequence (tok/s)"),
    ("makespan_s", "makespan (s)"),
    ("engine_busy", "engine busy (measured utilization)"),
    ("kv_usage_mean", "device KV in use, mean"),
    ("demotions", "demotions (pins given up)"),
    ("preemptions", "requests preempted (recompute)"),
    ("evicted_blocks", "device blocks evicted"),
)


def bench_workload(cfg: WorkloadConfig, token_scale: float = BENCH_TOKEN_SCALE) -> SimWorkload:
    """The plan of ``agentkv bench agents`` for ``cfg`` in the simulator's form.

    Up to EXACT_PLAN_MAX_TURNS turns it is the bench's own plan (``generate``); above, the same
    distributions drawn without text. Forks are not simulated (each fork's first branch is)."""
    from agentkv.simulate.workload import SimTrajectory, SimTurn, SimWorkload
    from agentkv_bench.workload import generate

    pre = round(cfg.prefix_tokens * token_scale)
    action = round(cfg.action_tokens * token_scale)
    trajs: list[SimTrajectory] = []
    Row = tuple[str | None, float, float | None, int]
    plans: list[tuple[str, float, list[Row]]]
    if cfg.trajectories * cfg.turns <= EXACT_PLAN_MAX_TURNS:
        plans = [
            (
                t.trajectory_id,
                t.start_s,
                [(u.tool, u.wait_s, u.expected_wait_s, u.observation_tokens) for u in t.turns[1:]],
            )
            for t in generate(cfg).trajectories
        ]
    else:
        plans = []
        weights = [t.weight for t in cfg.tools]
        for i in range(cfg.trajectories):
            rng = random.Random(f"{cfg.seed}:traj:{i}")
            rows: list[Row] = []
            for _ in range(2, cfg.turns + 1):
                dist = rng.choices(cfg.tools, weights=weights)[0]
                wait = dist.sample(rng) * cfg.time_scale
                raw = math.exp(rng.gauss(math.log(cfg.obs_median_tokens), cfg.obs_sigma))
                obs = int(min(cfg.obs_max_tokens, max(cfg.obs_min_tokens, raw)))
                rows.append((dist.name, wait, round(dist.median_s * cfg.time_scale, 4), obs))
            plans.append((f"bench-{cfg.seed}-{i}", i * cfg.stagger_s * cfg.time_scale, rows))
    for tid, start, rows in plans:
        first = SimTurn(pre, round(cfg.task_tokens * token_scale), cfg.action_tokens)
        turns = [first]
        for tool, wait, expected, obs in rows:
            turns.append(
                SimTurn(
                    turns[-1].prompt_tokens + action,
                    round(obs * token_scale),
                    cfg.action_tokens,
                    wait,
                    tool,
                    expected,
                )
            )
        trajs.append(SimTrajectory(tid, start, tuple(turns), pre, "bench"))
    return SimWorkload(tuple(trajs), f"bench agents {cfg.trajectories}x{cfg.turns}")


def _split(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    names = list(allowed) if value == "all" else [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        fail(f"unknown {what} {', '.join(bad) or value!r}; choose from: {', '.join(allowed)}, all")
    return names


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3f}" if abs(x) < 10 else f"{x:,.1f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


def _table(results: dict[str, SimResult]) -> Any:
    from rich.table import Table

    labels = list(results)
    table = Table(title="agentkv simulate", title_justify="left")
    table.add_column("metric")
    for label in labels:
        table.add_column(label, justify="right")
    pair = None
    van = [k for k in labels if k.endswith("/vanilla")]
    akv = [k for k in labels if k.endswith("/agentkv")]
    if len(van) == 1 and len(akv) == 1:
        pair = (akv[0], van[0])
        table.add_column("agentkv / vanilla", justify="right")
    loads = [results[k].load for k in labels]
    if any(x is not None for x in loads):
        table.add_row(
            "offered load (utilization, peak)",
            *[f"{x.utilization:.2f}" if x is not None else "-" for x in loads],
            *([""] if pair else []),
        )
    for key, name in SHOWN:
        row = [name] + [
            "overloaded"
            if results[k].truncated and key in LATENCY_ROWS
            else _fmt(results[k].summary.to_dict().get(key))
            for k in labels
        ]
        cut = pair is not None and any(results[k].truncated for k in pair)
        if pair is not None and cut and key in LATENCY_ROWS:
            row.append("-")
        elif pair is not None:
            a = results[pair[0]].summary.to_dict().get(key)
            v = results[pair[1]].summary.to_dict().get(key)
            ok = isinstance(a, (int, float)) and isinstance(v, (int, float)) and v
            row.append(f"{a / v:.3f}" if ok else "-")  # type: ignore[operator]
        table.add_row(*row)
    table.add_row(
        "pause decisions",
        *[
            ", ".join(f"{k} {n}" for k, n in results[k].summary.decisions.items()) or "-"
            for k in labels
        ],
        *([""] if pair else []),
    )
    if any(results[k].summary.prefetch for k in labels):
        table.add_row(
            "device prefetch",
            *[
                ", ".join(f"{k} {n}" for k, n in results[k].summary.prefetch.items()) or "-"
                for k in labels
            ],
            *([""] if pair else []),
        )
    return table


def simulate_cmd(
    ctx: typer.Context,
    trajectories: int | None = typer.Option(
        None, "--trajectories", "-n", min=1, help="Trajectories of the bench workload (default 6)."
    ),
    turns: int | None = typer.Option(
        None, "--turns", "-t", min=1, help="Turns per trajectory of the bench workload (default 5)."
    ),
    trace: Path | None = typer.Option(
        None,
        "--trace",
        exists=True,
        dir_okay=False,
        help="Simulate a recorded trace (TraceLab session CSV, canonical CSV or round JSONL, "
        "as `bench agents --trace`) instead of the bench's generator.",
    ),
    sessions: int | None = typer.Option(
        None,
        "--sessions",
        min=1,
        help="With --trace: only the first N sessions (as `bench agents`).",
    ),
    time_scale: float | None = typer.Option(
        None,
        "--time-scale",
        min=0.0,
        help="Multiplies every tool wait (bench generator default 0.1, as `bench agents`; "
        "traces default 1.0) and the start stagger.",
    ),
    token_scale: float | None = typer.Option(
        None,
        "--token-scale",
        min=0.0,
        help=f"Multiplies every token count (bench generator default {BENCH_TOKEN_SCALE}: the "
        "embedded tokenizer's real tokens per target token, chat template included; traces 1.0).",
    ),
    seed: int = typer.Option(0, "--seed", help="Workload seed (and Poisson arrivals with --rate)."),
    num_blocks: int | None = typer.Option(
        None,
        "--num-blocks",
        min=1,
        help="Device KV blocks per replica (default 128, as `bench agents`; with --gpu, what "
        "the GPUs hold after the weights at 0.9 utilization).",
    ),
    gpu: str | None = typer.Option(
        None,
        "--gpu",
        help="Engine costs from published figures instead of a calibration: H100 or H200 "
        "(with --model and --tp; docs/simulate.md lists the sources).",
    ),
    model_name: str = typer.Option(
        "llama-3.1-8b",
        "--model",
        help="With --gpu: llama-3.1-8b, llama-3.1-70b (GQA) or deepseek-v2-lite (MLA).",
    ),
    tp: int = typer.Option(
        1, "--tp", min=1, help="With --gpu: GPUs per replica (tensor parallel)."
    ),
    host_capacity_gib: float = typer.Option(
        2.0, "--host-capacity-gib", min=0.0, help="Host tier per replica (0: none)."
    ),
    disk_capacity_gib: float = typer.Option(
        0.0, "--disk-capacity-gib", min=0.0, help="Disk tier per replica (0: none)."
    ),
    remote_capacity_gib: float = typer.Option(
        0.0,
        "--remote-capacity-gib",
        min=0.0,
        help="A remote tier shared by every replica (0: none); offloads also go there, and a "
        "turn routed to another replica loads from it.",
    ),
    replicas: int = typer.Option(1, "--replicas", "-r", min=1, help="Replicas in the fleet."),
    router: str = typer.Option(
        "session-affinity",
        "--router",
        help="round-robin, session-affinity, least-loaded, kv-aware (vllm-router's cost with "
        "tier credits), affinity-load (the reference's mu/gamma objective); a comma list or "
        "'all' compares them.",
    ),
    policy: str = typer.Option(
        "vanilla,agentkv",
        "--policy",
        help="vanilla (prefix cache only), agentkv (agentkv's own decide/predict), "
        "retain-always (TTL pinning, Continuum-like), offload-always; a comma list or 'all'.",
    ),
    mu: float = typer.Option(
        0.5, "--mu", min=0.0, max=1.0, help="affinity-load: weight of the match."
    ),
    gamma: float = typer.Option(2.0, "--gamma", min=0.01, help="affinity-load: load exponent."),
    retain_ttl_s: float = typer.Option(
        60.0, "--retain-ttl", min=0.0, help="retain-always: seconds a paused trajectory is pinned."
    ),
    calibration: Path | None = typer.Option(
        None,
        "--calibration",
        exists=True,
        dir_okay=False,
        help="Engine costs: a simulator calibration JSON, an `agentkv calibrate` profile "
        "(bandwidths, prefill rate) or a `bench agents` report (a rough rate from its vanilla run). "
        "Default: the bench's engine (small model, 2-core CPU VM).",
    ),
    rate: float | None = typer.Option(
        None,
        "--rate",
        min=0.0,
        help="Start trajectories as a Poisson process of this many per second (instead of the "
        "bench's stagger or the trace's arrival times).",
    ),
    find: bool = typer.Option(
        False,
        "--find-replicas",
        help="Search the smallest replica count meeting --slo-ttft-p99, per router and policy.",
    ),
    slo_ttft_p99: float | None = typer.Option(
        None, "--slo-ttft-p99", min=0.0, help="TTFT p99 objective (s, all turns) for the search."
    ),
    max_replicas: int = typer.Option(64, "--max-replicas", min=1, help="Search limit."),
    compare_with: Path | None = typer.Option(
        None,
        "--compare",
        exists=True,
        dir_okay=False,
        help="A measured run (tests/unit/fixtures/simulate/*.json or a bench report.json): "
        "prints simulated vs measured with relative errors.",
    ),
    admission: str = typer.Option(
        "whole",
        "--admission",
        help="whole: a request waits until its prompt and output fit (validated default); "
        "chunk: vLLM 0.32's scheduler (admit when the prompt fits, allocate chunk by chunk, "
        "preempt the newest request by recompute when a running one needs a block).",
    ),
    device_prefetch: bool = typer.Option(
        False,
        "--device-prefetch",
        help="agentkv prefetches offloaded contexts back into device blocks at the predicted "
        "return, by the manager's rule (agentkv.prefetch_rule; the connector's device_prefetch).",
    ),
    full: bool = typer.Option(
        False,
        "--full",
        help="Simulate an unbounded overload to its end (default: stop after ten median "
        "trajectories, report the utilization, a warning and the smallest fleet that carries it).",
    ),
    plot: Path | None = typer.Option(None, "--plot", help="Write PNG plots into this folder."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON on stdout."),
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
    from dataclasses import replace

    from rich.console import Console

    from agentkv.errors import AgentKVError
    from agentkv.simulate.admission import Admission
    from agentkv.simulate.costs import BENCH_SMALL_CPU, Provenance, load_calibration
    from agentkv.simulate.fleet import FleetConfig, simulate
    from agentkv.simulate.load import offered_load
    from agentkv.simulate.policies import POLICIES
    from agentkv.simulate.routers import ROUTERS

    routers = _split(router, ROUTERS, "router")
    if admission not in {a.value for a in Admission}:
        fail(f"unknown --admission {admission!r}; choose from: whole, chunk")
    policies = _split(policy, POLICIES, "policy")
    if find and (rate is None or slo_ttft_p99 is None):
        fail("--find-replicas needs --rate and --slo-ttft-p99")
    if gpu is not None and calibration is not None:
        fail("--gpu and --calibration are exclusive")
    try:
        if gpu is not None:
            from agentkv.hardware import get_preset
            from agentkv.simulate.presets import get_model, gpu_costs, gpu_num_blocks

            costs = gpu_costs(gpu, model_name, tp)
            if num_blocks is None:
                num_blocks = gpu_num_blocks(get_preset(gpu), get_model(model_name), tp)
        else:
            costs = load_calibration(calibration) if calibration is not None else BENCH_SMALL_CPU
        if num_blocks is None:
            num_blocks = 128
        workload = _workload(trace, sessions or trajectories, turns, time_scale, token_scale, seed)
    except (AgentKVError, ValueError) as exc:
        fail(str(exc))
    err = Console(stderr=True)
    for note in costs.notes:
        err.print(f"[yellow]calibration:[/] {note}", soft_wrap=True)
    if rate is not None:
        if rate <= 0:
            fail("--rate must be positive")
        workload = workload.with_poisson_arrivals(rate, seed)
    base = FleetConfig(
        replicas=replicas,
        num_blocks=num_blocks,
        host_capacity_gib=host_capacity_gib,
        disk_capacity_gib=disk_capacity_gib,
        remote_capacity_gib=remote_capacity_gib,
        mu=mu,
        gamma=gamma,
        retain_ttl_s=retain_ttl_s,
        costs=costs,
        admission=Admission(admission),
        device_prefetch=device_prefetch,
    )
    combos = [(r, p) for r in routers for p in policies]
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # pipes and logs get the whole table, not wrapped cells
    if find:
        assert slo_ttft_p99 is not None
        _search(workload, base, combos, slo_ttft_p99, max_replicas, as_json, plot, rate, console)
        return

    load = offered_load(workload, costs, num_blocks, replicas)
    if not full:
        base = replace(base, horizon_s=load.horizon_s())
    warning = load.warning()
    if warning:
        err.print(f"[bold red]warning:[/] {warning}", soft_wrap=True)

    def run_all(on_progress: Any) -> dict[str, SimResult]:
        out: dict[str, SimResult] = {}
        for r, p in combos:
            label = f"{r}/{p}"

            def step(phase: str, done: int, total: int, label: str = label) -> None:
                on_progress(f"{label}: {phase}", done, total)

            out[label] = simulate(workload, replace(base, router=r, policy=p), step, load)
        return out

    results = with_progress(run_all)
    measured_rows = None
    if compare_with is not None:
        from agentkv.simulate.validate import compare, load_measured

        try:
            measured = load_measured(compare_with)
        except AgentKVError as exc:
            fail(str(exc))
        by_policy = {k.split("/", 1)[1]: v.summary.to_dict() for k, v in results.items()}
        measured_rows = compare(by_policy, measured["configs"])
    plots = []
    if plot is not None:
        from agentkv.simulate.plots import plot_results

        plots = [str(p) for p in plot_results(results, plot)]
    if as_json:
        typer.echo(
            json.dumps(
                {
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
            )
        )
        return
    console.print(
        f"{workload.name}: {len(workload.trajectories)} trajectories, {workload.turns} turns; "
        f"{replicas} replica(s) of {num_blocks} blocks, host {host_capacity_gib:g} GiB; "
        f"engine {costs.name} ({costs.provenance})"
    )
    console.print(_table(results))
    if measured_rows:
        from rich.table import Table

        title = "simulated vs measured"
        if costs.provenance is Provenance.FITTED_TO_RUN:
            title += " (engine costs fitted to the run: not a held-out prediction)"
        t = Table(title=title, title_justify="left")
        for c in ("config", "metric", "simulated", "measured", "error", "within 25%"):
            t.add_column(c, justify="left" if c in ("config", "metric") else "right")
        for row in measured_rows:
            t.add_row(
                row.config,
                row.metric,
                _fmt(row.simulated),
                _fmt(row.measured),
                "-" if row.rel_error is None else f"{row.rel_error:+.1%}",
                "-" if row.within is None else ("yes" if row.within else "NO"),
            )
        console.print(t)
    walls = ", ".join(f"{v.wall_s:.2f} s" for v in results.values())
    Console(stderr=True).print(
        f"simulated in {walls}" + (f"; plots: {', '.join(plots)}" if plots else "")
    )


def _search(
    workload: SimWorkload,
    base: Any,
    combos: list[tuple[str, str]],
    slo: float,
    max_replicas: int,
    as_json: bool,
    plot: Path | None,
    rate: float | None,
    console: Any,
) -> None:
    from dataclasses import replace

    from rich.table import Table

    from agentkv.simulate.search import find_replicas

    def run_all(on_progress: Any) -> list[Any]:
        return [
            find_replicas(
                workload, replace(base, router=r, policy=p), slo, max_replicas, on_progress
            )
            for r, p in combos
        ]

    found = with_progress(run_all)
    if plot is not None:
        from agentkv.simulate.plots import plot_results

        plot_results({f"{f.router}/{f.policy}": f.result for f in found if f.result}, plot)
    if as_json:
        typer.echo(
            json.dumps(
                {"rate_per_s": rate, "slo_ttft_p99_s": slo, "results": [f.to_dict() for f in found]}
            )
        )
        return
    table = Table(
        title=f"smallest fleet for TTFT p99 <= {slo:g} s at {rate:g} trajectories/s",
        title_justify="left",
    )
    for c in (
        "router",
        "policy",
        "replicas",
        "TTFT p99 (s)",
        "resume TTFT p50 (s)",
        "hit rate",
        "probes (replicas: p99)",
    ):
        table.add_column(c, justify="left" if c in ("router", "policy") else "right")
    for f in found:
        s = f.result.summary if f.result is not None else None
        table.add_row(
            f.router,
            f.policy,
            str(f.replicas) if f.replicas else f"> {max_replicas}",
            _fmt(f.ttft_p99_s),
            _fmt(s.resume_ttft_p50_s if s else None),
            _fmt(s.prefix_hit_rate if s else None),
            ", ".join(f"{n}: {_fmt(v)}" for n, v in sorted(f.probes.items())),
        )
    console.print(table)


def _workload(
    trace: Path | None,
    trajectories: int | None,
    turns: int | None,
    time_scale: float | None,
    token_scale: float | None,
    seed: int,
) -> SimWorkload:
    if trace is not None:
        from agentkv.simulate.workload import from_trace
        from agentkv.traces import load_trace

        tw = load_trace(trace)
        if trajectories is not None:
            tw = tw.head(trajectories)
        tw = tw.scaled(
            token_scale if token_scale is not None else 1.0,
            time_scale if time_scale is not None else 1.0,
        )
        return from_trace(tw)
    from agentkv_bench.workload import WorkloadConfig

    cfg = WorkloadConfig(seed=seed).with_overrides(
        trajectories=trajectories, turns=turns, time_scale=time_scale
    )
    return bench_workload(cfg, token_scale if token_scale is not None else BENCH_TOKEN_SCALE)


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
    token_scale: float = typer.Option(1.0, "--token-scale", min=0.0001),
    time_scale: float = typer.Option(1.0, "--time-scale", min=0.0),
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
    from agentkv.errors import AgentKVError
    from agentkv.simulate import protocol
    from agentkv.simulate.costs import BENCH_SMALL_CPU, load_calibration

    if predict_row is None:
        rows = protocol.table_rows()
        if as_json:
            typer.echo(json.dumps(rows))
            return
        _print_validation(rows)
        return
    try:
        costs = load_calibration(calibration) if calibration is not None else BENCH_SMALL_CPU
        workload = _workload(trace, None, None, time_scale, token_scale, 0)
    except (AgentKVError, ValueError) as exc:
        fail(str(exc))
    spec = protocol.RowSpec(
        predict_row,
        str(trace) if trace is not None else None,
        token_scale,
        time_scale,
        num_blocks,
        host_capacity_gib,
        str(calibration) if calibration is not None else None,
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


def _print_validation(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="predicted before the run vs measured", title_justify="left")
    for c in ("row", "commit", "config", "metric", "predicted", "measured", "error", "within"):
        table.add_column(
            c, justify="left" if c in ("row", "commit", "config", "metric") else "right"
        )
    for r in rows:
        commit = (r["commit"] or "uncommitted")[:9]
        if not r["metrics"]:
            table.add_row(r["row"], commit, "-", "not run yet", "", "", "", "")
            continue
        flag = "" if r.get("committed_before_run") else " (committed after the run)"
        flag += "" if r["held_out"] else " (calibration fitted to the run)"
        for config, key, pv, mv, err, ok in r["metrics"]:
            table.add_row(
                r["row"] + flag,
                commit,
                config,
                key,
                _fmt(pv),
                _fmt(mv),
                "-" if err is None else f"{err:+.0%}",
                "-" if ok is None else ("yes" if ok else "NO"),
            )
    Console(width=160).print(table)


def register(app: typer.Typer) -> None:
    """Add ``simulate`` (and ``simulate validate``) to the root app."""
    sim = typer.Typer(
        invoke_without_command=True,
        help="Simulate a fleet of vLLM replicas with agentkv behind a router.",
    )
    sim.callback()(simulate_cmd)
    sim.command("validate")(validate_cmd)
    app.add_typer(sim, name="simulate")
