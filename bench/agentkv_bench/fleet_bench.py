"""``agentkv bench fleet``: a recorded trace on several replicas behind vllm-router, vanilla vs
agentkv.

Primitives:
  FleetBenchOptions   the trace and its scales, replicas, model, pool per replica, output folder
  run_fleet_bench(opts, progress) -> the report; writes fleet-report.json and fleet-report.md

The two fleets run the same model, vLLM settings and device blocks per replica:
  vanilla   plain vLLM replicas (prefix caching) behind vllm-router ``cache_aware`` (its
            prefix-tree policy, the usual choice for multi-turn traffic without KV events)
  agentkv   vLLM + agentkv replicas publishing KV events, vllm-router ``kv_aware`` with session
            affinity (``x-session-id``), a shared Valkey remote tier
Each session is a closed loop through the router (``agentkv_bench.trace_replay``), every call
naming its session as harness_sdk does (``x-session-id``, and ``agent_hint`` + ``model`` in the
body, which is all vllm-router sees on agentkv's routes); agentkv's pause and resume go through
the router too. Only the final GET of per-turn stats and the DELETE go straight to the replica
holding the trajectory (found with GET on each replica; a GET has no body to route by).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agentkv.fleet import FleetSpec, RunningFleet, running_fleet
from agentkv_bench.progress import ProgressFn, reporter
from agentkv_bench.runner import machine_info
from agentkv_bench.trace_replay import TIMEOUT, SessionRecord, replay
from agentkv_bench.trace_report import summarize
from agentkv_bench.trace_runner import Sizing, TraceBenchOptions, plan

CONFIGS = ("vanilla", "agentkv")


@dataclass
class FleetBenchOptions:
    trace: Path
    token_scale: float = 1.0
    time_scale: float = 1.0
    sessions: int | None = None
    seed: int = 0
    preset: str = "small"
    replicas: int = 2
    num_blocks: int | None = None  # per replica; None: as the single-server trace bench
    host_capacity_gib: float = 1.0
    out: Path = Path("bench/results/fleet")
    extra_env: dict[str, str] = field(default_factory=lambda: {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    command: str = "agentkv bench fleet"


async def _locate(client: httpx.AsyncClient, fleet: RunningFleet, tid: str) -> str:
    for url in fleet.replica_urls:
        r = await client.get(f"{url}/agentkv/v1/trajectories/{tid}")
        if r.status_code == 200:
            return url
    return fleet.router_url


async def _drive(
    fleet: RunningFleet,
    name: str,
    workload: Any,
    prompts: Any,
    seed: int,
    on_round: Callable[[Any], None],
) -> tuple[list[SessionRecord], float]:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:

        async def locate(tid: str) -> str:
            return await _locate(client, fleet, tid)

        t0 = time.monotonic()
        sessions = await replay(
            workload,
            prompts,
            "agentkv" if name == "agentkv" else "vanilla",
            client,
            fleet.router_url,
            fleet.spec.model_name,
            f"fleet{seed}",
            on_round,
            None,
            t0,
            locate,
        )
        return sessions, time.monotonic() - t0


def run_fleet_bench(opts: FleetBenchOptions, progress: ProgressFn | None = None) -> dict[str, Any]:
    from agentkv import modelgen

    say = reporter(progress)

    workload, prompts, sizing = plan(
        TraceBenchOptions(
            trace=opts.trace,
            token_scale=opts.token_scale,
            time_scale=opts.time_scale,
            sessions=opts.sessions,
            seed=opts.seed,
            preset=opts.preset,
            num_blocks=opts.num_blocks,
        )
    )
    opts.out.mkdir(parents=True, exist_ok=True)
    model_dir = str(modelgen.ensure_model(opts.preset))
    total = workload.rounds
    summaries: dict[str, Any] = {}
    for name in CONFIGS:
        spec = _fleet_spec(opts, name, model_dir, sizing)
        say(f"{name}: starting {opts.replicas} replicas and the router", 0, total)
        with running_fleet(spec) as fleet:
            for url in fleet.replica_urls:  # one-off costs out of the measurement
                body = {"model": opts.preset, "prompt": [17] * 64, "max_tokens": 4}
                httpx.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()
            done = 0

            def on_round(_: Any, name: str = name) -> None:
                nonlocal done
                done += 1
                say(f"{name}: trace replay through the router", done, total)

            sessions, makespan = asyncio.run(
                _drive(fleet, name, workload, prompts, opts.seed, on_round)
            )
        summaries[name] = summarize(name, sessions, [], makespan).to_dict()
    a, v = summaries["agentkv"], summaries["vanilla"]

    def ratio(key: str) -> float | None:
        return a[key] / v[key] if a.get(key) and v.get(key) else None

    report = {
        "command": opts.command,
        "machine": machine_info(),
        "replicas": opts.replicas,
        "preset": opts.preset,
        "num_blocks_per_replica": sizing.num_blocks,
        "trace": {
            **workload.to_dict(),
            "path": str(opts.trace),
            "token_scale": opts.token_scale,
            "time_scale": opts.time_scale,
            "sessions_kept": opts.sessions,
        },
        "summaries": summaries,
        "ratios": {
            k: ratio(k)
            for k in ("resume_ttft_p50_s", "resume_ttft_p99_s", "jct_mean_s", "recomputed_tokens")
        },
    }
    (opts.out / "fleet-report.json").write_text(json.dumps(report, indent=2))
    (opts.out / "fleet-report.md").write_text(to_markdown(report))
    return report


def _fleet_spec(opts: FleetBenchOptions, name: str, model_dir: str, sizing: Sizing) -> FleetSpec:
    """One configuration's fleet: agentkv (kv_aware routing, the remote tier) or vanilla vLLM
    behind vllm-router's cache_aware policy."""
    work = Path(tempfile.mkdtemp(prefix=f"agentkv-bench-fleet-{name}-"))
    return FleetSpec(
        model=model_dir,
        replicas=opts.replicas,
        served_model_name=opts.preset,
        policy="kv_aware" if name == "agentkv" else "cache_aware",
        vanilla=name == "vanilla",
        remote=name == "agentkv",
        connector_config={"host_capacity_gib": opts.host_capacity_gib},
        num_blocks=sizing.num_blocks,
        kv_space_gib=sizing.kv_space_gib,
        max_model_len=sizing.max_model_len,
        extra_env={**opts.extra_env, "AGENTKV_PROFILE": str(work / "no-profile.json")},
        work_dir=work,
    )


def to_markdown(report: dict[str, Any]) -> str:
    s = report["summaries"]
    rows = [
        ("resume TTFT p50 (s)", "resume_ttft_p50_s"),
        ("resume TTFT p99 (s)", "resume_ttft_p99_s"),
        ("mean JCT (s)", "jct_mean_s"),
        ("tokens recomputed", "recomputed_tokens"),
        ("resume hit rate", "resume_hit_rate"),
    ]

    def fmt(x: Any) -> str:
        return "-" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))

    lines = [
        f"# Fleet: {report['replicas']} replicas behind vllm-router",
        "",
        f"    {report['command']}",
        "",
        "| metric | vanilla (cache_aware) | agentkv (kv_aware + affinity + remote) | ratio |",
        "|---|---:|---:|---:|",
    ]
    for label, key in rows:
        a, v = s["agentkv"].get(key), s["vanilla"].get(key)
        r = a / v if isinstance(a, (int, float)) and isinstance(v, (int, float)) and v else None
        lines.append(f"| {label} | {fmt(v)} | {fmt(a)} | {fmt(r)} |")
    return "\n".join(lines) + "\n"
