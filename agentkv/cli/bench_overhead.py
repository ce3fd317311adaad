"""``agentkv bench overhead``: what a plain request (no trajectory) costs on vLLM + agentkv against
vanilla vLLM, measured in phases (one server at a time, ABBA rounds, a bootstrap interval).

Only typer is imported at module level; the benchmark loads inside the command.
"""

from __future__ import annotations

from pathlib import Path

import typer

from agentkv.cli import bench_common as bench
from agentkv.cli.bench_common import bench_command
from agentkv.cli.common import fail


def overhead(
    phased: bool = typer.Option(
        True,
        "--phased/--no-phased",
        help="One server at a time (the only method: two vLLM CPU servers side by side disturb "
        "each other, see docs/bench.md); kept as a flag so the command says how it measures.",
    ),
    rounds: int = typer.Option(
        6, "--rounds", min=1, help="ABBA rounds: each starts a vanilla and an agentkv server once."
    ),
    requests: bench.Requests = 30,
    warmup: int = typer.Option(3, "--warmup", min=0, help="Untimed requests after each start."),
    prompt_tokens: bench.PromptTokens = 200,
    output_tokens: bench.OutputTokens = 16,
    preset: bench.Preset = "tiny",
    profile_s: float = typer.Option(
        0.0,
        "--profile-s",
        min=0.0,
        help="> 0: after round 0's measured requests of each configuration, py-spy records its "
        "engine core (and worker) this many seconds under the same plain traffic "
        "(pyspy-<config>.speedscope.json in --out; open in speedscope.app).",
    ),
    step_times: bool = typer.Option(
        False,
        "--step-times/--no-step-times",
        help="Also time vLLM's own engine-core and worker methods in every phase (a probe the "
        "servers load as sitecustomize) and report, per method, what agentkv adds, down to "
        "microseconds: the part of a step outside the model forward holds still between server "
        "starts, where end-to-end latency moves +-5%.",
    ),
    baseline: str = typer.Option(
        "vanilla",
        "--baseline",
        help="What agentkv is compared with: vanilla (vLLM with no plugin: agentkv's whole "
        "cost) or null-connector (vLLM with a KV connector that does nothing: agentkv's cost "
        "beyond vLLM's own connector plumbing, which any connector pays).",
    ),
    seed: bench.Seed = 0,
    out: Path = typer.Option(
        Path("bench/results/overhead"), "--out", help="Folder for report.json, report.md, logs."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the ratio and verdict as JSON."),
) -> None:
    """Plain requests on vanilla vLLM vs vLLM + agentkv, one server up at a time.

    Each round starts vanilla then agentkv (odd rounds: agentkv first), sends --warmup then
    --requests sequential plain requests (--prompt-tokens of fresh random token ids,
    --output-tokens greedy tokens, no agentkv params) and stops the server. Reports the ratio of
    median end-to-end latencies (agentkv / vanilla) with a 95% two-level bootstrap interval
    (rounds, then requests), each round's ratio, and a verdict against the <= 1.01 target:
    within, over, or undecided (the interval straddles 1.01: more rounds or a quieter machine).
    """
    if not phased:
        fail("only the phased method is offered: side by side, two CPU servers disturb each other")
    from agentkv_bench.phased import Baseline, PhasedOptions, run_phased

    try:
        base = Baseline(baseline)
    except ValueError:
        fail(
            f"--baseline must be one of: {', '.join(b.value for b in Baseline)} (got {baseline!r})"
        )

    opts = PhasedOptions(
        rounds=rounds,
        requests=requests,
        warmup=warmup,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        preset=preset,
        seed=seed,
        profile_s=profile_s,
        step_times=step_times,
        baseline=base,
        out=out,
        command=bench_command("overhead"),
    )
    keys = (
        "ratio",
        "verdict",
        "target",
        "per_round_ratio",
        "vanilla",
        "agentkv",
        "profiles",
        "step_times",
    )
    bench.show_report(lambda on_progress: run_phased(opts, on_progress), out, as_json, keys)


def register(app: typer.Typer) -> None:
    """Add ``overhead`` to the ``bench`` sub-app."""
    app.command("overhead")(overhead)
