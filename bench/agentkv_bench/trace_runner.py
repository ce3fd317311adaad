"""``agentkv bench agents --trace FILE``: one recorded workload on vanilla vLLM, agentkv and an
oracle, one after the other.

Primitives:
  TraceBenchOptions   the trace, its scales, the model, the pools, the output folder
  plan(opts)          -> (workload, prompts, sizing): the scaled trace, its token-id prompts, and
                      the pool sizes (refuses a pool that cannot hold the longest context)
  block_bytes_of(preset, block_tokens)  KV bytes of one block of an embedded model
  run_trace_bench(opts, progress) -> the report; writes report.json, report.md and the PNGs

The three configurations run the same model with the same vLLM settings and
``max_model_len``; vanilla and agentkv get ``num_blocks`` device blocks, the oracle (vanilla vLLM,
prefix caching) ``oracle_blocks(workload)``: enough that nothing of the workload is ever
evicted, so its resume rounds show the best any KV manager could do on this engine. For each:
start the server, one warm-up request, replay the trace while sampling KV occupancy, read
/metrics (and agentkv's status) before and after, stop the server. Then the resume stall is
taken apart with agentkv's reload rates and prefill rate, and the raw memcpy baseline is timed
in this process.
"""

from __future__ import annotations

import asyncio
import json
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agentkv.errors import ConfigError
from agentkv.launch import LaunchSpec, RunningServer, running_server
from agentkv.traces import TraceWorkload, load_trace
from agentkv_bench.copy_baseline import MemcpyTimer
from agentkv_bench.drivers import PauseVia
from agentkv_bench.matrix import SPECS, BenchConfig
from agentkv_bench.progress import ProgressFn, reporter
from agentkv_bench.report import writebacks
from agentkv_bench.runner import (
    BLOCK_TOKENS,
    connector_config,
    counting,
    machine_info,
    utc_stamp,
)
from agentkv_bench.sampler import Sampler
from agentkv_bench.stall_report import (
    StallRow,
    decompose,
    reload_phase_section,
    stall_section,
    tier_rates,
)
from agentkv_bench.trace_prompts import RoundPrompt, build_prompts, oracle_blocks
from agentkv_bench.trace_replay import (
    MODES,
    TIMEOUT,
    RoundRecord,
    SessionRecord,
    replay,
)
from agentkv_bench.trace_report import (
    TraceSummary,
    build_report,
    parse_prom,
    prom_delta,
    summarize,
    to_markdown,
    vllm_phases,
)


@dataclass
class TraceBenchOptions:
    trace: Path
    token_scale: float = 1.0
    time_scale: float = 1.0
    sessions: int | None = None  # keep only the first N sessions by arrival
    seed: int = 0
    preset: str = "small"
    num_blocks: int | None = None  # None: a quarter of the oracle's, at least two contexts
    host_capacity_gib: float = 2.0
    out: Path = Path("bench/results/trace")
    # Run in this order; agentkv must be among them (its status gives the stall's rates).
    configs: tuple[str, ...] = ("vanilla", "agentkv", "oracle")
    # Both cores for the worker: faster prefill, the same for every configuration.
    extra_env: dict[str, str] = field(default_factory=lambda: {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    ready_timeout_s: float = 600.0
    sample_interval_s: float = 0.5
    command: str = "agentkv bench agents --trace"
    disk: bool = False  # every agentkv offload to the disk tier
    prefetch: bool = True  # device prefetch in the agentkv configurations
    pause_via: PauseVia = PauseVia.ROUTES  # the trajectory driver's pause: control calls or
    # the request's pause_after


@dataclass(frozen=True)
class Sizing:
    num_blocks: int
    oracle_blocks: int
    max_model_len: int
    kv_space_gib: int
    block_bytes: int


def block_bytes_of(preset: str, block_tokens: int = BLOCK_TOKENS) -> int:
    """K and V of every layer for one block, bf16."""
    from agentkv.modelgen import get_preset

    p = get_preset(preset)
    return p.num_layers * 2 * p.num_kv_heads * p.head_dim * block_tokens * 2


def plan(opts: TraceBenchOptions) -> tuple[TraceWorkload, list[list[RoundPrompt]], Sizing]:
    """Load and scale the trace, build its prompts and size the pools."""
    workload = load_trace(opts.trace)
    if opts.sessions is not None:
        workload = workload.head(opts.sessions)
    try:
        workload = workload.scaled(opts.token_scale, opts.time_scale)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    prompts = build_prompts(workload, opts.seed)
    # The longest request, rounded up to whole blocks, plus one block vLLM keeps in reserve.
    longest = max(r.context_len for s in workload.sessions for r in s.rounds)
    context_blocks = math.ceil(longest / BLOCK_TOKENS)
    max_model_len = context_blocks * BLOCK_TOKENS
    oracle = max(oracle_blocks(workload, BLOCK_TOKENS), context_blocks + 1)
    num_blocks = (
        opts.num_blocks if opts.num_blocks is not None else max(2 * context_blocks + 2, oracle // 4)
    )
    if num_blocks < context_blocks + 1:
        raise ConfigError(
            f"--num-blocks {num_blocks} cannot hold the longest request of the scaled trace "
            f"({longest} tokens = {context_blocks} blocks of {BLOCK_TOKENS}, plus one vLLM "
            f"keeps in reserve): raise --num-blocks to >= {context_blocks + 1} or lower "
            "--token-scale"
        )
    bb = block_bytes_of(opts.preset)
    kv_gib = max(1, math.ceil(max(oracle, num_blocks) * bb * 1.05 / 2**30))
    return workload, prompts, Sizing(num_blocks, oracle, max_model_len, kv_gib, bb)


def _spec(
    opts: TraceBenchOptions, name: str, model_dir: str, work: Path, sizing: Sizing
) -> LaunchSpec:
    """Identical vLLM settings; agentkv (and the fixed-action configurations) add the connector
    (with their ``policy_override``), the oracle more blocks."""
    cs = SPECS[BenchConfig(name)]
    return LaunchSpec(
        model=model_dir,
        connector_config=connector_config(opts, name, work / f"disk-{name}"),
        kv_space_gib=sizing.kv_space_gib,
        num_blocks=sizing.oracle_blocks if cs.oracle_pool else sizing.num_blocks,
        served_model_name=opts.preset,
        max_model_len=sizing.max_model_len,
        extra_env={**opts.extra_env, "AGENTKV_PROFILE": str(work / "no-profile.json")},
        log_path=opts.out / f"server-trace-{name}.log",
        run_dir=work / f"run-{name}",
    )


def _warm_up(server: RunningServer) -> None:
    # The first request after start pays one-off costs (allocator, kernels) in every config.
    body = {"model": server.model, "prompt": [17] * 64, "max_tokens": 4, "temperature": 0}
    httpx.post(server.base_url + "/v1/completions", json=body, timeout=600).raise_for_status()


@dataclass
class _Run:
    sessions: list[SessionRecord]
    samples: list[Any]
    sampler_errors: int
    makespan_s: float
    prom: dict[tuple[str, str], float]
    status: dict[str, Any]


async def _drive(
    name: str,
    server: RunningServer,
    workload: TraceWorkload,
    prompts: list[list[RoundPrompt]],
    opts: TraceBenchOptions,
    on_round: Callable[[RoundRecord], None],
) -> _Run:
    agentkv = SPECS[BenchConfig(name)].connector
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
        before = parse_prom((await client.get(server.base_url + "/metrics")).text)
        paused: dict[str, int] = {}
        t_run = time.monotonic()
        sampler = Sampler(
            server.base_url,
            agentkv=agentkv,
            t_run=t_run,
            paused=lambda: (len(paused), sum(paused.values())),
            interval_s=opts.sample_interval_s,
        )
        async with sampler:
            sessions = await replay(
                workload,
                prompts,
                name,
                client,
                server.base_url,
                server.model,
                f"{opts.seed}",
                on_round,
                paused,
                t_run,
                pause_via=opts.pause_via,
            )
        makespan = time.monotonic() - t_run
        after = parse_prom((await client.get(server.base_url + "/metrics")).text)
        status: dict[str, Any] = {}
        if agentkv:
            r = await client.get(server.base_url + "/agentkv/v1/status")
            status = r.json() if r.status_code == 200 else {}
    return _Run(
        sessions, sampler.samples, sampler.errors, makespan, prom_delta(before, after), status
    )


def _prefill_rate(status: dict[str, Any]) -> tuple[float, str]:
    """agentkv's online prefill rate (the engine's own prefill steps) and where it came from."""
    live = ((status.get("profile") or {}).get("live") or {}).get("prefill_tokens_per_s") or {}
    value = live.get("value")
    if isinstance(value, (int, float)) and value > 0:
        src = str(live.get("source") or "agentkv status")
        return float(value), f"agentkv online profile: {src}, {live.get('samples', 0)} samples"
    raise ConfigError(
        "the agentkv server reported no prefill rate (GET /agentkv/v1/status profile.live); "
        "the resume stall cannot be taken apart"
    )


def run_trace_bench(opts: TraceBenchOptions, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Run every configuration and write ``report.json``, ``report.md`` and the PNGs.

    Raises agentkv.errors.ConfigError for a bad trace or sizes (TraceFormatError names the
    line), EngineUnavailableError when a server cannot start.
    """
    from agentkv import modelgen
    from agentkv_bench.plots import write_trace_plots

    say = reporter(progress)
    started_at = utc_stamp()
    unknown = [c for c in opts.configs if c not in MODES]
    if unknown or "agentkv" not in opts.configs:
        raise ConfigError(f"configs must include agentkv and be among {MODES}, got {opts.configs}")
    workload, prompts, sizing = plan(opts)
    opts.out.mkdir(parents=True, exist_ok=True)
    say(f"building model preset {opts.preset}")
    model_dir = str(modelgen.ensure_model(opts.preset))
    runs = _run_configs(opts, workload, prompts, sizing, model_dir, say)
    say("timing memcpy, writing the report")
    agentkv_run = runs["agentkv"]
    pool = agentkv_run.status.get("pool") or {}
    block_tokens = int(pool.get("block_size_tokens") or BLOCK_TOKENS)
    block_bytes = int(pool.get("block_bytes") or sizing.block_bytes)
    rate, rate_source = _prefill_rate(agentkv_run.status)
    rates = tier_rates(agentkv_run.prom)
    memcpy = MemcpyTimer(block_bytes)
    rows: dict[str, list[StallRow]] = {}
    summaries: dict[str, TraceSummary] = {}
    configs: dict[str, dict[str, Any]] = {}
    for name, run in runs.items():
        rounds = [r for s in run.sessions for r in s.rounds]
        rows[name] = decompose(
            rounds,
            block_tokens=block_tokens,
            block_bytes=block_bytes,
            rates=rates if name == "agentkv" else {},
            prefill_tokens_per_s=rate,
            memcpy=memcpy,
        )
        summaries[name] = summarize(name, run.sessions, run.samples, run.makespan_s, block_tokens)
        summaries[name].writeback_blocks = writebacks(run.status)
        if not summaries[name].decisions and run.status.get("decisions"):
            # Paused by their requests (--pause-via request): no round saw its decision; the
            # engine's count of them stands in.
            summaries[name].decisions = {
                str(k): int(v) for k, v in run.status["decisions"].items() if v
            }
        configs[name] = _config_section(name, run, sizing, rounds, rows[name])
    stall = stall_section(
        rows, rates, rate, rate_source, memcpy, reload_phase_section(agentkv_run.prom)
    )
    report = build_report(
        command=opts.command,
        machine=machine_info(),
        server={
            "preset": opts.preset,
            "model_dir": model_dir,
            "num_blocks": sizing.num_blocks,
            "oracle_blocks": sizing.oracle_blocks,
            "block_tokens": block_tokens,
            "block_bytes": block_bytes,
            "kv_space_gib": sizing.kv_space_gib,
            "max_model_len": sizing.max_model_len,
            "host_capacity_gib": opts.host_capacity_gib,
            "env": opts.extra_env,
        },
        trace={
            **workload.to_dict(),
            "path": str(opts.trace),
            "token_scale": opts.token_scale,
            "time_scale": opts.time_scale,
            "seed": opts.seed,
            "sessions_kept": opts.sessions,
            "pause_via": opts.pause_via.value,
        },
        configs=configs,
        summaries=summaries,
        stall=stall,
    )
    report["started_at"] = started_at
    (opts.out / "report.json").write_text(json.dumps(report, indent=1))
    (opts.out / "report.md").write_text(to_markdown(report))
    write_trace_plots(report, opts.out)
    return report


def _run_configs(
    opts: TraceBenchOptions,
    workload: TraceWorkload,
    prompts: list[list[RoundPrompt]],
    sizing: Sizing,
    model_dir: str,
    say: ProgressFn,
) -> dict[str, _Run]:
    """The trace replayed on each configuration's server in turn, one server up at a time."""
    total = workload.rounds
    work = Path(tempfile.mkdtemp(prefix="agentkv-bench-trace-"))
    runs: dict[str, _Run] = {}
    for name in opts.configs:
        say(f"{name}: starting vLLM", 0, total)
        with running_server(
            _spec(opts, name, model_dir, work, sizing), ready_timeout_s=opts.ready_timeout_s
        ) as server:
            _warm_up(server)
            on_round = counting(say, f"{name}: trace replay", total)
            runs[name] = asyncio.run(_drive(name, server, workload, prompts, opts, on_round))
    return runs


def _config_section(
    name: str, run: _Run, sizing: Sizing, rounds: list[RoundRecord], stall: list[StallRow]
) -> dict[str, Any]:
    """One configuration's section of report.json: its counters, sessions, rounds, stall rows
    and occupancy samples."""
    return {
        "makespan_s": run.makespan_s,
        "num_blocks": sizing.oracle_blocks
        if SPECS[BenchConfig(name)].oracle_pool
        else sizing.num_blocks,
        "agentkv_counters": (run.status.get("counters") or {}) if run.status else None,
        "device_prefetch": run.status.get("device_prefetch") if run.status else None,
        "vllm_phases": vllm_phases(run.prom),
        "engine_counters": {f"{k}{{tier={t}}}" if t else k: v for (k, t), v in run.prom.items()},
        "sampler_errors": run.sampler_errors,
        "sessions": [
            {
                "session_id": s.session_id,
                "trajectory_id": s.trajectory_id,
                "started_at_s": s.started_at_s,
                "jct_s": s.jct_s,
            }
            for s in run.sessions
        ],
        "rounds": [r.to_dict() for r in rounds],
        "stall": [row.to_dict() for row in stall],
        "samples": [s.to_dict() for s in run.samples],
    }
