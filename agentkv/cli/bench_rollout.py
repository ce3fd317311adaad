"""``agentkv bench rollout``: an RL rollout (parallel multi-turn trajectories, environment steps,
a real weight sync between rollout steps) on vanilla vLLM vs vLLM + agentkv, one server up at
a time, at a tight and a roomy pool.

Only typer is imported at module level; the benchmark loads inside the command.
"""

from __future__ import annotations

from pathlib import Path

import typer

from agentkv.cli import bench_common as bench
from agentkv.cli.bench_common import bench_command
from agentkv.cli.common import fail, json_object


def _pools(text: str | None) -> dict[str, int] | None:
    """``--num-blocks TIGHT,ROOMY`` (either may be empty: sized from the shape)."""
    if text is None:
        return None
    parts = text.split(",")
    if len(parts) != 2:
        fail(f"--num-blocks takes TIGHT,ROOMY (two block counts), got {text!r}")
    out: dict[str, int] = {}
    for kind, part in zip(("tight", "roomy"), parts, strict=True):
        if not part.strip():
            continue
        try:
            out[kind] = int(part)
        except ValueError:
            fail(f"--num-blocks: {part!r} is not a block count")
        if out[kind] < 8:
            fail(f"--num-blocks: {kind} pool of {out[kind]} blocks is below 8")
    return out


def rollout(
    trajectories: int = typer.Option(8, "--trajectories", min=1, help="Trajectories per step."),
    group: int = typer.Option(
        2, "--group", min=1, help="Samples per prompt (GRPO's group): they share the task tokens."
    ),
    turns: int = typer.Option(5, "--turns", min=1, help="Generations per trajectory."),
    steps: int = typer.Option(
        2, "--steps", min=1, help="Rollout steps; a real weight sync runs between two."
    ),
    system_tokens: int = typer.Option(
        1024, "--system-tokens", min=0, help="The instruction template, the same in every step."
    ),
    task_tokens: int = typer.Option(
        512, "--task-tokens", min=0, help="Each group's task, new in every step."
    ),
    observation_tokens: int = typer.Option(
        768,
        "--observation-tokens",
        min=0,
        help="What each environment step returns (a tool's output).",
    ),
    output_tokens: bench.OutputTokens = 32,
    env_median_s: float = typer.Option(
        0.33,
        "--env-median-s",
        min=0.0,
        help="Median environment step (lognormal). The default and --env-sigma's are fitted "
        "to the tool waits of the public TraceLab trace multi_session_large.csv.",
    ),
    env_sigma: float = typer.Option(0.66, "--env-sigma", min=0.0, help="Log-space sigma."),
    num_blocks: str | None = typer.Option(
        None,
        "--num-blocks",
        help="TIGHT,ROOMY device pool sizes in 128-token blocks (default: 40% and 200% of "
        "every trajectory's final context, so the tight pool cannot keep the contexts that "
        "wait on their environment and the roomy one never evicts).",
    ),
    host_capacity_gib: float = typer.Option(
        4.0, "--host-capacity-gib", min=0.01, help="agentkv's host tier."
    ),
    connector_config: str | None = typer.Option(
        None,
        "--connector-config",
        help="JSON object of connector settings added to agentkv's (defaults otherwise).",
    ),
    quick: bool = typer.Option(
        False,
        "--quick",
        help="A smoke run: 4 trajectories x 3 turns x 2 steps, short prompts (~5 min here: four server starts).",
    ),
    preset: bench.Preset = "tiny",
    seed: bench.Seed = 0,
    out: Path = typer.Option(
        Path("bench/results/rollout"), "--out", help="Folder for report.json, report.md, logs."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the pools' ratios as JSON."),
) -> None:
    """An RL rollout on vanilla vLLM vs vLLM + agentkv, at a tight and a roomy pool.

    Each rollout step starts --trajectories trajectories together, each --turns generations
    with an environment step between two (token ids in and out over /v1/completions, as AReaL
    and SkyRL drive vLLM), then the trainer syncs new weights (OpenRLHF's
    /collective_rpc update_weight with a really perturbed checkpoint, and a plain
    /reset_prefix_cache) and the next step starts. agentkv gets the one line an RL framework
    adds (docs/rl.md): each request's trajectory id with implicit_pause, nothing else.

    Reports per pool and configuration the rollout step's wall time, the tokens prefilled and
    the resume TTFT, the speedup (vanilla / agentkv) against issue 41's targets (tight >= 1.3,
    roomy >= 0.97) and the tier blocks left after each sync (0: nothing older loadable).
    Four server starts; the default shape takes about 10-15 minutes on 2 cores.
    """
    from agentkv_bench.rollout import RolloutShape
    from agentkv_bench.rollout_report import PoolKind
    from agentkv_bench.rollout_run import RolloutOptions, run_rollout

    if quick:
        trajectories, group, turns, steps = 4, 2, 3, 2
        system_tokens, task_tokens, observation_tokens, output_tokens = 256, 128, 64, 16
    try:
        shape = RolloutShape(
            trajectories=trajectories,
            group=group,
            turns=turns,
            steps=steps,
            system_tokens=system_tokens,
            task_tokens=task_tokens,
            observation_tokens=observation_tokens,
            output_tokens=output_tokens,
            env_median_s=env_median_s,
            env_sigma=env_sigma,
            seed=seed,
        )
    except ValueError as exc:
        fail(str(exc))
    pools = _pools(num_blocks)
    from agentkv_bench.rollout_run import default_pools

    sized = default_pools(shape)
    blocks = {k: (pools or {}).get(k.value, sized[k]) for k in PoolKind}
    opts = RolloutOptions(
        shape=shape,
        out=out,
        preset=preset,
        num_blocks=blocks,
        host_capacity_gib=host_capacity_gib,
        connector_settings=json_object(connector_config, "--connector-config")
        if connector_config
        else {},
        command=bench_command("rollout"),
    )
    bench.show_report(lambda on_progress: run_rollout(opts, on_progress), out, as_json, ("pools",))


def register(app: typer.Typer) -> None:
    """Add ``rollout`` to the ``bench`` sub-app."""
    app.command("rollout")(rollout)
