"""``agentkv bench scale``: does a plain request get slower while many trajectories sit idle?

One agentkv server (tiny embedded model, a host tier large enough for every idle trajectory).
Every measurement phase sends the same kind of traffic: ``requests`` sequential plain requests
(a ``prompt_tokens``-token prompt of fresh random token ids, ``output_tokens`` greedy tokens,
``ignore_eos``, no agentkv params), timed end to end by the client, with the connector's CPU
clocks (``connector_cpu`` in ``GET /agentkv/v1/status``) and vLLM's engine step count
(``/metrics``) read before and after. The phases:

  none     no trajectory has existed yet (the fresh server);
  held     ``idle`` idle trajectories exist: each was created by one short chat turn with
           ``kv_transfer_params.agentkv.trajectory_id = "idle-<i>"`` and ``max_tokens`` 1
           (``concurrency`` at a time), and every grace period has expired (each branch
           offloaded to the host tier, no job in flight): the manager's table holds them all,
           and nothing is left for the engine to do for them;
  deleted  after ``DELETE /agentkv/v1/trajectories/idle-<i>`` for every one of them.

``rounds`` times: create, held, delete, deleted. So the sequence is none, held, deleted, held,
deleted, ...: every held phase sits between two phases without trajectories, and its ratio is
taken against the mean of those two neighbours. On a shared 2-core machine plain-request latency
drifts by tens of percent over minutes (vanilla vLLM alone shows it), far more than the 5% being
checked; bracketing each held phase by its neighbours in time cancels most of that drift, and
the reported ratio is the median over rounds. The connector CPU per engine step is thread CPU
time, much less sensitive to other load than wall-clock latency.

Pure parts (unit-tested): ``latency_stats``, ``phase_summary``, ``pooled``, ``bracketed``,
``ratios``, ``targets``, ``build_report``, ``to_markdown``. ``run_scale`` drives a server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agentkv_bench import connector_cpu
from agentkv_bench.report import percentile
from agentkv_bench.workload import filler

SCHEMA = "agentkv-bench-scale/1"
KINDS = ("none", "held", "deleted")
TARGET_RATIO = 1.05  # "within 5%"
# Token ids for the plain prompts: above the embedded tokenizers' special tokens and byte
# alphabet, below their vocabulary size (8192).
TOKEN_LO, TOKEN_HI = 300, 8000
# Branch states that mean "still running, deciding or moving"; settled = none of these.
UNSETTLED_STATES = ("active", "held", "offloading")

ProgressFn = Callable[[str, int, int], None]
Phase = dict[str, Any]


@dataclass
class ScaleOptions:
    idle: int = 2000
    requests: int = 30
    rounds: int = 3
    prompt_tokens: int = 200
    output_tokens: int = 16
    # Chat content of each idle trajectory: with the chat template a bit more than one
    # 128-token block, so each trajectory leaves one full block in the host tier.
    idle_prompt_tokens: int = 150
    concurrency: int = 8
    warmup: int = 3
    preset: str = "tiny"
    num_blocks: int = 256
    kv_space_gib: int = 1
    host_capacity_gib: float = 2.0
    max_model_len: int = 4096
    seed: int = 0
    settle_timeout_s: float = 600.0
    ready_timeout_s: float = 600.0
    out: Path = Path("bench/results/scale")
    # One OMP thread for the model, a core left for the API server, the scheduler and the bench
    # client: on a 2-core machine, two OMP threads slow down several-fold whenever anything else
    # runs (a busy core stalls their barrier), which made latency bimodal (~65 vs ~140 ms).
    extra_env: dict[str, str] = field(default_factory=lambda: {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
    command: str = "agentkv bench scale"


# ---------------------------------------------------------------------------- pure: the math


def latency_stats(latencies_s: Sequence[float]) -> dict[str, float | None]:
    """p50 / p90 / mean / min / max of the latencies, in milliseconds."""
    ms = [x * 1000.0 for x in latencies_s]
    return {
        "p50_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "mean_ms": sum(ms) / len(ms) if ms else None,
        "min_ms": min(ms) if ms else None,
        "max_ms": max(ms) if ms else None,
    }


def phase_summary(
    kind: str,
    round_: int,
    latencies_s: Sequence[float],
    before: Mapping[str, Any] | None,
    after: Mapping[str, Any] | None,
    wall_s: float,
    status: Mapping[str, Any] | None = None,
    background_cores: float | None = None,
) -> Phase:
    """One phase: latency stats and the connector CPU between two ``connector_cpu.read_probe``
    results. ``status``: the server's status body just before the phase. ``background_cores``:
    CPU used meanwhile by processes other than the server and the bench, in cores."""
    d, steps = connector_cpu.probe_delta(before, after)
    cpu = connector_cpu.figures(d, wall_s=wall_s, requests=0, engine_steps=steps)
    status = status or {}
    host = ((status.get("tiers") or {}).get("host")) or {}
    return {
        "kind": kind,
        "round": round_,
        "requests": len(latencies_s),
        "latencies_ms": [round(x * 1000.0, 3) for x in latencies_s],
        **latency_stats(latencies_s),
        "wall_s": wall_s,
        "background_cores": background_cores,
        "connector_cpu": cpu,
        "trajectories": status.get("trajectories"),
        "branches_by_state": {
            k: v for k, v in (status.get("branches_by_state") or {}).items() if v
        },
        "host_blocks": host.get("blocks"),
        "host_bytes": host.get("bytes"),
    }


def step_us(phase: Mapping[str, Any]) -> float | None:
    """Connector CPU per engine step (µs): per vLLM engine step when the server's metrics
    counted them, else per step-hook call."""
    cpu = phase.get("connector_cpu") or {}
    v = cpu.get("step_us_per_engine_step")
    return v if v is not None else cpu.get("step_us_per_call")


def pooled(phases: Sequence[Mapping[str, Any]], kind: str) -> dict[str, Any] | None:
    """All phases of ``kind`` together: latency stats over every request, connector CPU per
    step = all their step CPU over all their engine steps (or step-hook calls)."""
    sel = [p for p in phases if p["kind"] == kind]
    if not sel:
        return None
    lat = [x / 1000.0 for p in sel for x in p["latencies_ms"]]
    cpus = [p.get("connector_cpu") or {} for p in sel]
    cpu_s = sum(c.get("step_cpu_s") or 0.0 for c in cpus)
    calls = sum(c.get("step_calls") or 0 for c in cpus)
    counted = [c.get("engine_steps") for c in cpus]
    steps = sum(int(s) for s in counted if s is not None) if None not in counted else None
    per_step = _per_us(cpu_s, steps) if steps else _per_us(cpu_s, calls)
    bg = [p["background_cores"] for p in sel if p.get("background_cores") is not None]
    last = sel[-1]
    return {
        "kind": kind,
        "phases": len(sel),
        "requests": len(lat),
        **latency_stats(lat),
        "step_us": per_step,
        "step_calls": calls,
        "engine_steps": steps,
        "background_cores_mean": sum(bg) / len(bg) if bg else None,
        "trajectories": last.get("trajectories"),
        "host_blocks": last.get("host_blocks"),
    }


def _per_us(cpu_s: float, n: int | None) -> float | None:
    return cpu_s * 1e6 / n if n else None


def _ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x is not None and y else None


def _mean_of(
    phases: Sequence[Mapping[str, Any]], get: Callable[[Mapping[str, Any]], float | None]
) -> float | None:
    vals = [v for v in map(get, phases) if v is not None]
    return sum(vals) / len(vals) if vals else None


def bracketed(phases: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """For each held phase: its p50 / p90 latency and per-step CPU over the mean of its
    neighbours in time without trajectories (the phase just before and just after)."""
    out = []
    for i, p in enumerate(phases):
        if p["kind"] != "held":
            continue
        nb = [
            q
            for q in (
                phases[i - 1] if i > 0 else None,
                phases[i + 1] if i + 1 < len(phases) else None,
            )
            if q is not None and q["kind"] != "held"
        ]
        if not nb:
            continue
        b50 = _mean_of(nb, lambda q: q.get("p50_ms"))
        b90 = _mean_of(nb, lambda q: q.get("p90_ms"))
        bcpu = _mean_of(nb, step_us)
        out.append(
            {
                "round": p["round"],
                "p50_ms": p.get("p50_ms"),
                "base_p50_ms": b50,
                "p50_latency": _ratio(p.get("p50_ms"), b50),
                "p90_latency": _ratio(p.get("p90_ms"), b90),
                "step_us": step_us(p),
                "base_step_us": bcpu,
                "step_cpu": _ratio(step_us(p), bcpu),
            }
        )
    return out


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def ratios(phases: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``held/none``: median over rounds of the bracketed ratios (the headline).
    ``held/none pooled``: all held requests against all requests without trajectories.
    ``deleted/none``: after deleting against the fresh server (drift over the run)."""
    rounds = bracketed(phases)
    fresh, held, deleted = (pooled(phases, k) for k in KINDS)
    empty = [p for p in phases if p["kind"] != "held"]
    no_traj = pooled([{**p, "kind": "x"} for p in empty], "x")

    def pair(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> dict[str, Any]:
        if a is None or b is None:
            return {"p50_latency": None, "p90_latency": None, "step_cpu": None}
        return {
            "p50_latency": _ratio(a.get("p50_ms"), b.get("p50_ms")),
            "p90_latency": _ratio(a.get("p90_ms"), b.get("p90_ms")),
            "step_cpu": _ratio(a.get("step_us"), b.get("step_us")),
        }

    return {
        "held/none": {
            "p50_latency": _median([r["p50_latency"] for r in rounds]),
            "p90_latency": _median([r["p90_latency"] for r in rounds]),
            "step_cpu": _median([r["step_cpu"] for r in rounds]),
            "rounds": rounds,
        },
        "held/none pooled": pair(held, no_traj),
        "deleted/none": pair(deleted, fresh),
    }


def targets(r: Mapping[str, Any], limit: float = TARGET_RATIO) -> list[dict[str, Any]]:
    """The issue's targets: with the idle trajectories held, the plain request's p50 latency and
    the connector's CPU per engine step within 5% of none (bracketed, median over rounds)."""
    held = r.get("held/none") or {}
    out = []
    for key, label in (
        ("p50_latency", "plain request p50 latency, held / none"),
        ("step_cpu", "connector CPU per engine step, held / none"),
    ):
        m = held.get(key)
        out.append(
            {
                "name": label,
                "goal": f"<= {limit:.2f}",
                "measured": m,
                "met": None if m is None else m <= limit,
            }
        )
    return out


def build_report(
    *,
    command: str,
    machine: Mapping[str, Any],
    server: Mapping[str, Any],
    options: Mapping[str, Any],
    idle: Sequence[Mapping[str, Any]],
    phases: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    r = ratios(phases)
    return {
        "schema": SCHEMA,
        "command": command,
        "machine": dict(machine),
        "server": dict(server),
        "options": dict(options),
        "idle_rounds": [dict(x) for x in idle],
        "phases": [dict(p) for p in phases],
        "summary": {k: pooled(phases, k) for k in KINDS},
        "ratios": r,
        "targets": targets(r),
    }


def _f(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def to_markdown(report: Mapping[str, Any]) -> str:
    opts, srv = report["options"], report["server"]
    summ = {k: v for k, v in report["summary"].items() if v is not None}
    idle = report["idle_rounds"]
    created = idle[0].get("created") if idle else opts.get("idle")
    names = [k for k in KINDS if k in summ]
    labels = {
        "none": "no trajectories (fresh server)",
        "held": f"{created} idle trajectories held",
        "deleted": "after deleting them",
    }
    lines = [
        "# agentkv bench scale",
        "",
        f"`{report['command']}`",
        "",
        f"Model `{srv.get('preset')}`, {srv.get('num_blocks')} device KV blocks, host tier "
        f"{srv.get('host_capacity_gib')} GiB. Each phase: {opts.get('requests')} sequential plain "
        f"requests ({opts.get('prompt_tokens')}-token prompt, {opts.get('output_tokens')} greedy "
        "output tokens, no trajectory), timed by the client; connector CPU = the difference of "
        "`connector_cpu.step` in `GET /agentkv/v1/status` over the phase, per engine step "
        f"(vLLM's step count). {opts.get('rounds')} rounds of create / held / delete / deleted; "
        "columns pool the phases of each kind.",
        "",
        "| | " + " | ".join(labels[n] for n in names) + " |",
        "|---|" + "---:|" * len(names),
    ]

    def row(label: str, key: str, digits: int = 1) -> None:
        lines.append(
            f"| {label} | " + " | ".join(_f(summ[n].get(key), digits) for n in names) + " |"
        )

    row("phases", "phases")
    row("trajectories in the table", "trajectories")
    row("host tier blocks", "host_blocks")
    row("plain request latency p50 (ms)", "p50_ms")
    row("plain request latency p90 (ms)", "p90_ms")
    row("plain request latency mean (ms)", "mean_ms")
    row("engine steps", "engine_steps")
    row("connector CPU per engine step (µs)", "step_us", 2)
    row("other processes' CPU meanwhile (cores)", "background_cores_mean", 2)
    held = report["ratios"]["held/none"]
    lines += [
        "",
        "Per round, each held phase against the mean of its neighbours without trajectories:",
        "",
        "| round | p50 before/after (ms) | p50 held (ms) | p50 ratio | CPU/step before/after (µs) "
        "| CPU/step held (µs) | CPU ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in held["rounds"]:
        lines.append(
            f"| {r['round']} | {_f(r['base_p50_ms'])} | {_f(r['p50_ms'])} | "
            f"{_f(r['p50_latency'], 3)} | {_f(r['base_step_us'], 2)} | {_f(r['step_us'], 2)} | "
            f"{_f(r['step_cpu'], 3)} |"
        )
    lines += [
        "",
        "| ratio | p50 latency | p90 latency | connector CPU per step |",
        "|---|---:|---:|---:|",
    ]
    for key, r in report["ratios"].items():
        label = f"{key} (median of rounds)" if key == "held/none" else key
        lines.append(
            f"| {label} | {_f(r.get('p50_latency'), 3)} | {_f(r.get('p90_latency'), 3)} | "
            f"{_f(r.get('step_cpu'), 3)} |"
        )
    lines += ["", "| target | goal | measured | met |", "|---|---|---:|---|"]
    for t in report["targets"]:
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "no")
        lines.append(f"| {t['name']} | {t['goal']} | {_f(t['measured'], 3)} | {met} |")
    lines.append("")
    for i, x in enumerate(idle):
        lines.append(
            f"Round {i}: {x.get('created')} idle trajectories created in "
            f"{_f(x.get('create_s'))} s (concurrency {opts.get('concurrency')}, mean prompt "
            f"{_f(x.get('prompt_tokens_mean'))} tokens), settled (grace expired, stores done) "
            f"{_f(x.get('settle_s'))} s later; deleted in {_f(x.get('delete_s'))} s."
        )
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- driving a server


def plain_prompt(rng: random.Random, tokens: int) -> list[int]:
    """Fresh random token ids: no prefix-cache hit between two requests (or phases)."""
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(tokens)]


def plain_latencies(
    client: httpx.Client,
    base_url: str,
    model: str,
    opts: ScaleOptions,
    rng: random.Random,
    n: int,
    on_done: Callable[[int], None] | None = None,
) -> list[float]:
    out = []
    for i in range(n):
        body = {
            "model": model,
            "prompt": plain_prompt(rng, opts.prompt_tokens),
            "max_tokens": opts.output_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        t0 = time.perf_counter()
        r = client.post(base_url + "/v1/completions", json=body)
        dt = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"plain request failed: {r.status_code} {r.text[:300]}")
        got = r.json()["usage"]["completion_tokens"]
        if got != opts.output_tokens:
            raise RuntimeError(f"plain request generated {got} tokens, not {opts.output_tokens}")
        out.append(dt)
        if on_done is not None:
            on_done(i + 1)
    return out


def _status(client: httpx.Client, base_url: str) -> dict[str, Any]:
    r = client.get(base_url + "/agentkv/v1/status")
    r.raise_for_status()
    body: dict[str, Any] = r.json()
    return body


class CpuMeter:
    """Machine CPU used by processes other than the server's process group and this one
    (Linux ``/proc``): how busy the rest of a shared machine was during a phase."""

    def __init__(self, server_pgid: int) -> None:
        self.pgid = server_pgid
        self.tick = os.sysconf("SC_CLK_TCK")

    def _machine_busy(self) -> float:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
        return (sum(vals[:8]) - idle) / self.tick

    def _group(self) -> float:
        total = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # rest[0] is the state (field 3); pgrp is field 5, utime/stime fields 14/15.
            if int(rest[2]) == self.pgid:
                total += int(rest[11]) + int(rest[12])
        return total / self.tick

    def read(self) -> tuple[float, float, float] | None:
        try:
            t = os.times()
            return self._machine_busy(), self._group(), t.user + t.system
        except (OSError, ValueError, IndexError):
            return None

    @staticmethod
    def cores(
        a: tuple[float, float, float] | None, b: tuple[float, float, float] | None, wall_s: float
    ) -> float | None:
        if a is None or b is None or wall_s <= 0:
            return None
        other = (b[0] - a[0]) - (b[1] - a[1]) - (b[2] - a[2])
        return max(0.0, other) / wall_s


def measure_phase(
    kind: str,
    round_: int,
    client: httpx.Client,
    base_url: str,
    model: str,
    opts: ScaleOptions,
    rng: random.Random,
    meter: CpuMeter,
    say: ProgressFn,
) -> Phase:
    plain_latencies(client, base_url, model, opts, rng, opts.warmup)
    status = _status(client, base_url)
    before = connector_cpu.read_probe(base_url)
    m0 = meter.read()
    t0 = time.perf_counter()
    label = f"round {round_}: {kind}: plain requests"
    lat = plain_latencies(
        client, base_url, model, opts, rng, opts.requests, lambda d: say(label, d, opts.requests)
    )
    wall = time.perf_counter() - t0
    bg = CpuMeter.cores(m0, meter.read(), wall)
    after = connector_cpu.read_probe(base_url)
    return phase_summary(kind, round_, lat, before, after, wall, status, bg)


async def _create_idle(
    base_url: str, model: str, opts: ScaleOptions, round_: int, say: ProgressFn
) -> dict[str, Any]:
    rng = random.Random(opts.seed * 1000 + round_ + 1)
    contents = [
        filler(rng, opts.idle_prompt_tokens, header=f"idle trajectory {i}")
        for i in range(opts.idle)
    ]
    sem = asyncio.Semaphore(opts.concurrency)
    prompt_tokens: list[int] = []
    label = f"round {round_}: creating idle trajectories"

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0)) as client:

        async def one(i: int) -> None:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": contents[i]}],
                "max_tokens": 1,
                "temperature": 0,
                "kv_transfer_params": {"agentkv": {"trajectory_id": f"idle-{i}"}},
            }
            async with sem:
                r = await client.post(base_url + "/v1/chat/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"idle trajectory {i} failed: {r.status_code} {r.text[:300]}")
            prompt_tokens.append(int(r.json()["usage"]["prompt_tokens"]))
            say(label, len(prompt_tokens), opts.idle)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(opts.idle)))
        create_s = time.perf_counter() - t0
    return {
        "round": round_,
        "created": len(prompt_tokens),
        "create_s": create_s,
        "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None,
    }


async def _delete_idle(base_url: str, opts: ScaleOptions, round_: int, say: ProgressFn) -> float:
    sem = asyncio.Semaphore(opts.concurrency)
    done = 0
    label = f"round {round_}: deleting idle trajectories"
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0)) as client:

        async def one(i: int) -> None:
            nonlocal done
            async with sem:
                r = await client.delete(base_url + f"/agentkv/v1/trajectories/idle-{i}")
            if r.status_code not in (200, 404):
                raise RuntimeError(f"delete idle-{i}: {r.status_code} {r.text[:300]}")
            done += 1
            say(label, done, opts.idle)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(opts.idle)))
        return time.perf_counter() - t0


def settled(status: Mapping[str, Any], expect_trajectories: int) -> bool:
    """``expect_trajectories`` in the table, none running, in its grace period or being stored,
    and no tier job in flight."""
    states = status.get("branches_by_state") or {}
    jobs = (status.get("tiers") or {}).get("in_flight_jobs", 0)
    return (
        status.get("trajectories") == expect_trajectories
        and not any(states.get(s) for s in UNSETTLED_STATES)
        and not jobs
    )


def _wait(
    client: httpx.Client,
    base_url: str,
    ok: Callable[[dict[str, Any]], bool],
    what: str,
    timeout_s: float,
    say: ProgressFn,
) -> float:
    t0 = time.perf_counter()
    while True:
        st = _status(client, base_url)
        if ok(st):
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout_s:
            raise RuntimeError(
                f"{what}: not reached after {timeout_s:.0f} s; status: "
                + json.dumps({k: st.get(k) for k in ("trajectories", "branches_by_state", "tiers")})
            )
        say(what, 0, 0)
        time.sleep(0.5)


def run_scale(opts: ScaleOptions, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Start the server, run none + ``rounds`` x (held, deleted), write report.json/.md."""
    from agentkv import modelgen
    from agentkv.launch import LaunchSpec, running_server
    from agentkv_bench.runner import machine_info

    def say(phase: str, done: int = 0, total: int = 0) -> None:
        if progress is not None:
            progress(phase, done, total)

    opts.out.mkdir(parents=True, exist_ok=True)
    say(f"building model preset {opts.preset}")
    model_dir = str(modelgen.ensure_model(opts.preset))
    work = Path(tempfile.mkdtemp(prefix="agentkv-bench-scale-"))
    spec = LaunchSpec(
        model=model_dir,
        connector_config={"host_capacity_gib": opts.host_capacity_gib},
        kv_space_gib=opts.kv_space_gib,
        num_blocks=opts.num_blocks,
        served_model_name=opts.preset,
        max_model_len=opts.max_model_len,
        extra_env={**opts.extra_env, "AGENTKV_PROFILE": str(work / "no-profile.json")},
        log_path=opts.out / "server.log",
        run_dir=work / "run",
    )
    rng = random.Random(opts.seed)
    phases: list[Phase] = []
    idle: list[dict[str, Any]] = []
    final: dict[str, Any] = {}
    say("starting vLLM")
    with (
        running_server(spec, ready_timeout_s=opts.ready_timeout_s) as server,
        httpx.Client(timeout=httpx.Timeout(600.0, connect=30.0)) as client,
    ):
        base, model = server.base_url, server.model
        meter = CpuMeter(server.proc.pid)

        def measure(kind: str, r: int) -> None:
            phases.append(measure_phase(kind, r, client, base, model, opts, rng, meter, say))

        measure("none", 0)
        for r in range(opts.rounds):
            info = asyncio.run(_create_idle(base, model, opts, r, say))
            info["settle_s"] = _wait(
                client,
                base,
                lambda st: settled(st, opts.idle),
                f"round {r}: waiting for grace periods to expire",
                opts.settle_timeout_s,
                say,
            )
            measure("held", r)
            info["delete_s"] = asyncio.run(_delete_idle(base, opts, r, say))
            info["delete_settle_s"] = _wait(
                client,
                base,
                lambda st: settled(st, 0),
                f"round {r}: waiting for deletes to settle",
                opts.settle_timeout_s,
                say,
            )
            idle.append(info)
            measure("deleted", r)
        with contextlib.suppress(httpx.HTTPError):
            final = {
                k: v
                for k, v in _status(client, base).items()
                if k in ("trajectories", "tombstones", "tiers", "counters", "connector_cpu")
            }
    say("writing the report")
    report = build_report(
        command=opts.command,
        machine=machine_info(),
        server={
            "preset": opts.preset,
            "model_dir": model_dir,
            "num_blocks": opts.num_blocks,
            "kv_space_gib": opts.kv_space_gib,
            "host_capacity_gib": opts.host_capacity_gib,
            "max_model_len": opts.max_model_len,
            "env": opts.extra_env,
        },
        options={
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in asdict(opts).items()
            if k not in ("extra_env", "command")
        },
        idle=idle,
        phases=phases,
    )
    report["final_status"] = final
    (opts.out / "report.json").write_text(json.dumps(report, indent=1))
    (opts.out / "report.md").write_text(to_markdown(report))
    return report
