"""``agentkv bench scale``: a plain request's latency and the connector's CPU per engine step,
with no trajectories, with many idle ones held, and after deleting them.

Only typer is imported at module level; the benchmark loads inside the command.
"""

from __future__ import annotations

from pathlib import Path

import typer

from agentkv.cli import bench_common as bench
from agentkv.cli.bench_common import bench_command


def scale(
    idle: int = typer.Option(
        2000, "--idle", min=1, help="Idle trajectories to create (one short chat turn each)."
    ),
    requests: bench.Requests = 30,
    rounds: int = typer.Option(
        3,
        "--rounds",
        min=1,
        help="Create / measure / delete / measure cycles; each held phase is compared with its "
        "neighbours in time without trajectories, and the median over rounds is reported.",
    ),
    prompt_tokens: bench.PromptTokens = 200,
    output_tokens: bench.OutputTokens = 16,
    concurrency: int = typer.Option(
        8, "--concurrency", min=1, help="Idle trajectories created (and deleted) at a time."
    ),
    preset: bench.Preset = "tiny",
    host_capacity_gib: float = typer.Option(
        2.0,
        "--host-capacity-gib",
        min=0.1,
        help="Host tier size; each idle trajectory keeps one 128-token block there "
        "(256 KiB with the tiny model).",
    ),
    seed: bench.Seed = 0,
    out: Path = typer.Option(
        Path("bench/results/scale"), "--out", help="Folder for report.json, report.md, the log."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print the phases' figures, ratios and targets as JSON on stdout."
    ),
) -> None:
    """Measure what idle trajectories cost requests that do not use them.

    Starts one vLLM + agentkv server (embedded model, host tier). Each phase times sequential
    plain requests (no trajectory; p50, p90) and takes the connector's CPU per engine step (the
    change of connector_cpu.step in GET /agentkv/v1/status over the phase, over the engine steps
    vLLM's /metrics counted).

    Phases: "none" on the fresh server; then --rounds times "held" (after --idle trajectories
    were created, one chat turn each with max_tokens 1, and their grace periods expired, their
    KV offloaded to the host tier) and "deleted" (after DELETE /agentkv/v1/trajectories/{id} for
    each of them).

    Reports held/none (each held phase over the mean of its neighbours without trajectories,
    median over rounds; target: within 5% for p50 latency and CPU per step), deleted/none and
    the absolute numbers, as report.json and report.md in --out.
    """
    from agentkv_bench.scale import ScaleOptions, run_scale

    opts = ScaleOptions(
        idle=idle,
        requests=requests,
        rounds=rounds,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        concurrency=concurrency,
        preset=preset,
        host_capacity_gib=host_capacity_gib,
        seed=seed,
        out=out,
        command=bench_command("scale"),
    )
    keys = ("summary", "ratios", "targets", "idle_rounds")
    bench.show_report(lambda on_progress: run_scale(opts, on_progress), out, as_json, keys)


def register(app: typer.Typer) -> None:
    """Add ``scale`` to the ``bench`` sub-app."""
    app.command("scale")(scale)
