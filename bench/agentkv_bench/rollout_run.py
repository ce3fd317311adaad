"""One ``agentkv bench rollout`` run: the same rollout on vanilla vLLM and on vLLM + agentkv at each
pool size, one server up at a time, then report.json and report.md.

Sequence: build (or reuse) the model preset and the trainer's checkpoints (one perturbed copy
per weight sync, in the run's temporary folder); for each pool size (tight, roomy) start
vanilla, run every step, stop it, then the same with agentkv (on alternate pools agentkv goes
first, so a machine that drifts during the run does not favour one side). Both servers get the
same vLLM settings, the trainer's worker extension and dev mode (``/collective_rpc`` and
``/reset_prefix_cache`` are dev routes); only the connector differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agentkv.launch import LaunchSpec, RunningServer, running_server
from agentkv_bench.progress import ProgressFn, reporter
from agentkv_bench.rollout import (
    ENV_NAME,
    RolloutError,
    RolloutShape,
    StepResult,
    TurnResult,
    context_blocks,
    run_steps,
)
from agentkv_bench.rollout_report import PoolKind, compare, summarize, to_markdown, verdict
from agentkv_bench.rollout_weights import EXTENSION, perturbed_checkpoint, sync_body
from agentkv_bench.runner import BLOCK_TOKENS, machine_info, utc_stamp

CONFIGS = ("vanilla", "agentkv")
TIGHT_FRACTION = 0.4  # of every trajectory's final context: paused contexts must leave the pool
ROOMY_FACTOR = 2.0  # every trajectory's final context twice over: nothing is ever evicted
RESET_TRIES = 50
# The bench reads the learned waits, which /agentkv/v1/status shows the operator only; a key of
# the run's own (the bench owns the server), never one from the caller's environment.
OPERATOR_KEY = secrets.token_hex(16)
OPERATOR_HEADER = "X-AgentKV-Operator-Key"


@dataclass
class RolloutOptions:
    """Everything one run needs; ``num_blocks`` maps a pool kind to its block count (None:
    sized from the shape, ``default_pools``)."""

    shape: RolloutShape
    out: Path
    preset: str = "tiny"
    num_blocks: dict[PoolKind, int] | None = None
    host_capacity_gib: float = 4.0
    # vLLM's CPU KV space (VLLM_CPU_KVCACHE_SPACE): without it vLLM reserves most of the RAM;
    # the block cap (--num-gpu-blocks-override) is what sizes the pool.
    kv_space_gib: int = 2
    connector_settings: dict[str, Any] = field(default_factory=dict)
    max_model_len: int = 8192
    command: str = "agentkv bench rollout"


def default_pools(shape: RolloutShape, block_tokens: int = BLOCK_TOKENS) -> dict[PoolKind, int]:
    """Tight: 40% of the blocks every trajectory's final context needs (no sharing counted), so
    the contexts waiting on their environment cannot all stay; roomy: twice them all. Never
    below what one trajectory's last turn needs plus one block."""
    one = context_blocks(shape, block_tokens)
    everyone = one * shape.trajectories
    floor = one + 1
    return {
        PoolKind.TIGHT: max(floor, math.ceil(everyone * TIGHT_FRACTION)),
        PoolKind.ROOMY: max(floor, math.ceil(everyone * ROOMY_FACTOR)),
    }


def connector_config(opts: RolloutOptions, disk_dir: Path) -> dict[str, Any]:
    """agentkv's connector at its defaults, but for its own disk folder, the host tier's size
    and what ``--connector-config`` adds. The one line per request (``implicit_pause`` and the
    trajectory id) rides in each request, not here."""
    return {"host_capacity_gib": opts.host_capacity_gib, "disk_dir": str(disk_dir)} | dict(
        opts.connector_settings
    )


def _spec(
    opts: RolloutOptions, name: str, kind: PoolKind, blocks: int, model_dir: str, work: Path
) -> LaunchSpec:
    tag = f"{name}-{kind.value}"
    return LaunchSpec(
        model=model_dir,
        connector_config=connector_config(opts, work / f"disk-{tag}")
        if name == "agentkv"
        else None,
        kv_space_gib=opts.kv_space_gib,
        num_blocks=blocks,
        served_model_name=opts.preset,
        # vLLM refuses a pool that cannot hold one request of max_model_len: the longest
        # context the rollout makes, plus a block, fits every pool default_pools sizes.
        max_model_len=min(
            opts.max_model_len, (context_blocks(opts.shape, BLOCK_TOKENS) + 1) * BLOCK_TOKENS
        ),
        extra_args=("--worker-extension-cls", EXTENSION),
        extra_env={
            # vLLM's CPU backend keeps one core back for the engine process, and one more when
            # any KV connector is configured: on 2 cores that is all of them, so it falls back
            # to none and the agentkv worker would get both cores where vanilla's gets one.
            # Both get both.
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_SERVER_DEV_MODE": "1",
            "AGENTKV_PROFILE": str(work / "no-profile.json"),
            "AGENTKV_OPERATOR_KEY": OPERATOR_KEY,
        },
        log_path=opts.out / f"server-{tag}.log",
        run_dir=work / f"run-{tag}",
    )


async def _reset(client: httpx.AsyncClient) -> None:
    """A plain prefix-cache reset, retried while vLLM still holds a block the sync just freed
    (it answers an error then, and agentkv's released pins return on the next engine step)."""
    for _ in range(RESET_TRIES):
        r = await client.post("/reset_prefix_cache")
        if r.status_code == 200:
            return
        await asyncio.sleep(0.2)
    raise RolloutError(f"/reset_prefix_cache kept failing: {r.status_code} {r.text[:300]}")


def http_sync(
    base_url: str,
    checkpoints: list[Path],
    with_agentkv: bool,
    headers: dict[str, str] | None = None,
) -> Callable[[int], Awaitable[tuple[float, int | None]]]:
    """The trainer's sync after step k: OpenRLHF's ``update_weight`` RPC loading checkpoint k,
    then a plain prefix-cache reset; answers its seconds and (agentkv) the host and disk blocks
    left in the tiers right after it."""

    async def sync(k: int) -> tuple[float, int | None]:
        async with httpx.AsyncClient(base_url=base_url, timeout=600.0, headers=headers) as client:
            t0 = time.monotonic()
            r = await client.post("/collective_rpc", json=sync_body(checkpoints[k]))
            if r.status_code != 200:
                raise RolloutError(f"/collective_rpc answered {r.status_code}: {r.text[:300]}")
            await _reset(client)
            took = time.monotonic() - t0
            if not with_agentkv:
                return took, None
            status = (await client.get("/agentkv/v1/status")).json()
            tiers = status.get("tiers", {})
            left = sum(int(tiers.get(t, {}).get("blocks", 0)) for t in ("host", "disk"))
            return took, left

    return sync


def _warm_up(server: RunningServer) -> None:
    # The first request after a start pays one-off costs (allocator, kernels) in either config.
    body = {"model": server.model, "prompt": list(range(100, 300)), "max_tokens": 4}
    httpx.post(server.base_url + "/v1/completions", json=body, timeout=600).raise_for_status()


def _learned(server: RunningServer) -> dict[str, Any]:
    """What agentkv decided over the run: its pause decisions, the implicit pauses and the
    environment's learned waits (``/agentkv/v1/status``)."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        body = httpx.get(
            server.base_url + "/agentkv/v1/status",
            headers={OPERATOR_HEADER: OPERATOR_KEY},
            timeout=30,
        ).json()
        counters = body.get("counters", {})
        return {
            "decisions": body.get("decisions", {}),
            "implicit_pauses": counters.get("implicit_pauses", 0),
            "implicit_pause_skipped": {
                k: v for k, v in counters.items() if k.startswith("implicit_pause_skipped")
            },
            "waits_learned": body.get("predictor", {}).get(ENV_NAME, 0),
        }
    return {}


def _write_turns(path: Path, steps: list[StepResult]) -> None:
    """Every request's record, one JSON object a line (the report's figures come from these)."""
    with path.open("w") as f:
        for step in steps:
            for t in step.turns:
                row = asdict(t)
                row["output_tokens"] = len(row.pop("output_ids"))
                f.write(json.dumps(row) + "\n")


def run_rollout(opts: RolloutOptions, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Run every pool and configuration; write report.json and report.md into ``opts.out``.

    Raises agentkv.errors.EngineUnavailableError when a server cannot start, RolloutError when
    a request or a sync fails."""
    from agentkv import modelgen

    say = reporter(progress)
    started_at = utc_stamp()
    opts.out.mkdir(parents=True, exist_ok=True)
    say(f"building model preset {opts.preset}")
    model_dir = modelgen.ensure_model(opts.preset)
    shape = opts.shape
    work = Path(tempfile.mkdtemp(prefix="agentkv-bench-rollout-"))
    say("writing the trainer's checkpoints")
    checkpoints = [
        perturbed_checkpoint(model_dir, work / "checkpoints" / f"step-{k + 1}", 9000 + k)
        for k in range(shape.steps - 1)
    ]
    pools = opts.num_blocks or default_pools(shape)
    total = shape.trajectories * shape.turns * shape.steps
    results = []
    for i, (kind, blocks) in enumerate(pools.items()):
        order = CONFIGS if i % 2 == 0 else CONFIGS[::-1]
        configs: dict[str, Any] = {}
        for name in order:
            spec = _spec(opts, name, kind, blocks, str(model_dir), work)
            phase = f"{kind.value} pool ({blocks} blocks), {name}"
            say(f"{phase}: starting the server")
            with running_server(spec) as server:
                _warm_up(server)
                done = 0

                def on_turn(_: TurnResult, phase: str = phase) -> None:
                    nonlocal done
                    done += 1
                    say(phase, done, total)

                steps: list[StepResult] = asyncio.run(
                    run_steps(
                        server.base_url,
                        server.model,
                        shape,
                        name == "agentkv",
                        http_sync(server.base_url, checkpoints, name == "agentkv"),
                        on_turn,
                    )
                )
                _write_turns(opts.out / f"turns-{name}-{kind.value}.jsonl", steps)
                summary = summarize(steps)
                if name == "agentkv":
                    summary["agentkv"] = _learned(server)
                configs[name] = summary
        ratios = compare(configs["vanilla"], configs["agentkv"])
        results.append(
            {
                "kind": kind.value,
                "num_blocks": blocks,
                "configs": configs,
                "ratios": ratios,
                "verdict": verdict(kind, ratios["step_speedup"]),
            }
        )
    say("writing the report")
    report = {
        "command": opts.command,
        "started_at": started_at,
        "machine": machine_info(),
        "preset": opts.preset,
        "shape": asdict(shape),
        "block_tokens": BLOCK_TOKENS,
        "host_capacity_gib": opts.host_capacity_gib,
        "connector_settings": opts.connector_settings,
        "pools": results,
    }
    (opts.out / "report.json").write_text(json.dumps(report, indent=1))
    (opts.out / "report.md").write_text(to_markdown(report))
    return report
