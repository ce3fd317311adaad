"""``agentkv bench fleet``: a recorded trace on vanilla replicas vs agentkv replicas, both behind
vllm-router. Only typer is imported at module level."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from agentkv.cli.bench_common import run_or_fail


def fleet(
    trace: Path = typer.Option(
        ..., "--trace", exists=True, dir_okay=False, help="TraceLab session CSV or round JSONL."
    ),
    replicas: int = typer.Option(2, "--replicas", min=1, help="Replicas in each fleet."),
    token_scale: float = typer.Option(1.0, "--token-scale", help="Multiplies every token count."),
    time_scale: float = typer.Option(
        1.0, "--time-scale", help="Multiplies every wait and arrival."
    ),
    sessions: int | None = typer.Option(None, "--sessions", help="Keep the first N sessions."),
    num_blocks: int | None = typer.Option(
        None, "--num-blocks", help="Device KV blocks per replica (128 tokens each on CPU)."
    ),
    preset: str = typer.Option("small", "--preset", help="Embedded model: tiny or small."),
    seed: int = typer.Option(0, "--seed"),
    out: Path = typer.Option(Path("bench/results/fleet"), "--out", help="Report folder."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Replay a recorded agent trace through vllm-router on two fleets of REPLICAS servers:
    vanilla vLLM behind `cache_aware`, and vLLM + agentkv behind `kv_aware` with session
    affinity, KV events and a shared Valkey remote tier. Reports resume TTFT p50/p99, mean job
    completion time and tokens recomputed, with agentkv/vanilla ratios (fleet-report.json/.md).
    Example: agentkv bench fleet --trace multi_session_large.csv --token-scale 0.25 --time-scale 10
    """
    from rich.console import Console
    from rich.markdown import Markdown

    from agentkv_bench.fleet_bench import FleetBenchOptions, run_fleet_bench, to_markdown

    opts = FleetBenchOptions(
        trace=trace,
        token_scale=token_scale,
        time_scale=time_scale,
        sessions=sessions,
        seed=seed,
        preset=preset,
        replicas=replicas,
        num_blocks=num_blocks,
        out=out,
        command="agentkv bench fleet "
        + " ".join(
            f"--{k} {v}"
            for k, v in (
                ("trace", trace),
                ("replicas", replicas),
                ("token-scale", token_scale),
                ("time-scale", time_scale),
                ("sessions", sessions),
                ("num-blocks", num_blocks),
                ("preset", preset),
            )
            if v is not None
        ),
    )
    report = run_or_fail(lambda on_progress: run_fleet_bench(opts, on_progress))
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        Console().print(Markdown(to_markdown(report)))


def register(app: typer.Typer) -> None:
    app.command("fleet")(fleet)
