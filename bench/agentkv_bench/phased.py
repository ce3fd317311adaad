"""``agentkv bench overhead``: what a plain request (no trajectory) costs on vLLM + agentkv against
vanilla vLLM, end to end, measured in phases.

Primitives (pure, unit-tested):
  phase_order(rounds)        the ABBA order of the phases: A B, B A, A B, ... (counterbalanced:
                             a linear drift over a round charges both sides alike)
  ratio_of_medians(a, b)     median(b) / median(a) of pooled latencies
  bootstrap_ratio(a_phases, b_phases, ...) -> RatioCI   point estimate and a percentile
                             bootstrap interval of the ratio of medians, resampling rounds and,
                             inside each resampled phase, its requests (two-level: the spread
                             between server starts and the spread between requests both count)
  per_round_ratios(a_phases, b_phases)  each round's median(b) / median(a)
  verdict(ci, phases)        within / over / undecided, refusing one on too few rounds or a
                             busy machine
  profile_summary(speedscope) -> share of samples with an agentkv frame, its top frames
  build_report(...), to_markdown(report)
Driving servers: ``run_phased(opts, progress)`` (one server up at a time), with an optional
py-spy profile of each configuration's engine core (``profile_engine``).

Why phases. Two vLLM CPU servers on 2 cores disturb each other even while one is idle (the
measured fact in ../shared/docs/vllm-cpu.md: paired ratio IQR 0.12-1.95). The bench's older
``--overhead`` ran both servers side by side and timed one short ``vllm bench serve`` burst
(24 prompts, concurrency 4, a few seconds) per server per repeat, and reported the median of 5
paired throughput losses: each burst was shorter than the machine's load swings (other
engineers' tests, the other server's engine threads), the idle neighbour's busy engine loop took
CPU from the measured one, and 5 medians give no interval. So it swung +0.2% to -45% between
repeats. Here each phase is one server alone (start, warm up, ``requests`` sequential plain
requests timed by the client, stop), phases alternate ABBA over ``rounds`` rounds, and the answer
is the ratio of medians with a bootstrap confidence interval: the question "is the cost <= 1%"
is answered only when the interval's upper end is at most 1.01; an interval that straddles says
the machine was too noisy to tell.
"""

from __future__ import annotations

import functools
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentkv_bench import step_probe
from agentkv_bench.progress import ProgressFn, reporter

if TYPE_CHECKING:
    from agentkv.launch import LaunchSpec

SCHEMA = "agentkv-bench-overhead/1"


class Baseline(str, Enum):
    """What the agentkv phases are compared with (the A phases)."""

    VANILLA = "vanilla"  # vLLM with no plugin and no connector
    NULL_CONNECTOR = "null-connector"  # vLLM with a KV connector that does nothing


BASELINE_TEXT = {
    Baseline.VANILLA: "vanilla vLLM",
    Baseline.NULL_CONNECTOR: "vLLM with a do-nothing KV connector "
    "(agentkv_bench.null_connector: vLLM's connector plumbing, none of agentkv)",
}
A, B = "vanilla", "agentkv"
TARGET_RATIO = 1.01  # "a request without agentkv params must cost what it costs in vanilla"
# Below this many rounds a round-level bootstrap has too few distinct resamples to mean anything.
MIN_ROUNDS = 4
# Other processes using more than this many cores during a phase: its latencies measure them.
BUSY_CORES = 0.5
# Untimed requests after a probed phase's window: ~17 steps each, enough to flush the probe's
# last batch (128 records) in the engine core and the worker.
FLUSH_REQUESTS = 4


# ---------------------------------------------------------------------------- pure: the math


def phase_order(rounds: int) -> list[tuple[int, str]]:
    """(round, config) in run order: round r runs A then B when r is even, B then A when odd."""
    out: list[tuple[int, str]] = []
    for r in range(rounds):
        pair = (A, B) if r % 2 == 0 else (B, A)
        out += [(r, c) for c in pair]
    return out


def ratio_of_medians(a: Sequence[float], b: Sequence[float]) -> float | None:
    if not a or not b:
        return None
    ma = statistics.median(a)
    return statistics.median(b) / ma if ma > 0 else None


@dataclass(frozen=True)
class RatioCI:
    ratio: float | None  # median(all b) / median(all a)
    lo: float | None
    hi: float | None
    level: float
    resamples: int
    rounds: int

    def verdict(self, limit: float = TARGET_RATIO) -> str:
        """within (the interval is at most ``limit``), over (its lower end is above), or
        undecided (it straddles ``limit``: more rounds or a quieter machine)."""
        if self.lo is None or self.hi is None:
            return "not measured"
        if self.hi <= limit:
            return "within"
        if self.lo > limit:
            return "over"
        return "undecided"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _flat(phases: Sequence[Sequence[float]]) -> list[float]:
    return [x for p in phases for x in p]


def bootstrap_ratio(
    a_phases: Sequence[Sequence[float]],
    b_phases: Sequence[Sequence[float]],
    *,
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> RatioCI:
    """Ratio of medians (b over a) and its two-level percentile bootstrap interval.

    ``a_phases[r]`` / ``b_phases[r]``: the latencies of round r's phase of each configuration.
    Each resample draws rounds with replacement (a round keeps its A and B phases together:
    they ran minutes apart on the same machine state), then each drawn phase's requests with
    replacement, and takes the ratio of the pooled medians.
    """
    n = min(len(a_phases), len(b_phases))
    a_phases, b_phases = [p for p in a_phases[:n]], [p for p in b_phases[:n]]
    point = ratio_of_medians(_flat(a_phases), _flat(b_phases))
    if n == 0 or point is None or any(not p for p in a_phases + b_phases):
        return RatioCI(point, None, None, level, 0, n)
    rng = random.Random(seed)
    stats: list[float] = []
    for _ in range(resamples):
        rounds = [rng.randrange(n) for _ in range(n)]
        a = [x for r in rounds for x in rng.choices(a_phases[r], k=len(a_phases[r]))]
        b = [x for r in rounds for x in rng.choices(b_phases[r], k=len(b_phases[r]))]
        v = ratio_of_medians(a, b)
        if v is not None:
            stats.append(v)
    if not stats:
        return RatioCI(point, None, None, level, 0, n)
    stats.sort()
    tail = (1.0 - level) / 2.0
    lo = stats[min(len(stats) - 1, int(tail * len(stats)))]
    hi = stats[min(len(stats) - 1, int((1.0 - tail) * len(stats)))]
    return RatioCI(point, lo, hi, level, len(stats), n)


def verdict(ci: RatioCI, phases: Sequence[Mapping[str, Any]]) -> str:
    """``ci.verdict()``, unless the run cannot support one: fewer than MIN_ROUNDS rounds, or a
    phase during which other processes kept more than BUSY_CORES cores busy."""
    if ci.rounds < MIN_ROUNDS:
        return f"undecided: {ci.rounds} rounds (a verdict needs >= {MIN_ROUNDS})"
    busy = [b for p in phases if isinstance(b := p.get("other_cores_busy"), (int, float))]
    if busy and max(busy) > BUSY_CORES:
        return (
            f"undecided: other processes kept up to {max(busy):.2f} cores busy during a phase "
            f"(a verdict needs <= {BUSY_CORES})"
        )
    return ci.verdict()


def per_round_ratios(
    a_phases: Sequence[Sequence[float]], b_phases: Sequence[Sequence[float]]
) -> list[float | None]:
    return [ratio_of_medians(a, b) for a, b in zip(a_phases, b_phases, strict=False)]


def profile_summary(profile: Mapping[str, Any], needle: str = "agentkv") -> dict[str, Any]:
    """A py-spy speedscope profile read for the connector: samples in all, the share with a
    frame whose file path contains ``needle`` (the connector and the core: ``agentkv/``,
    ``agentkv_vllm/``) anywhere on the stack, and the five such frames seen most often
    (inclusive: a frame counts once per sample that has it)."""
    frames = (profile.get("shared") or {}).get("frames") or []
    ours = {i for i, f in enumerate(frames) if needle in str(f.get("file") or "")}
    total = 0.0
    hit = 0.0
    per_frame: dict[int, float] = {}
    for prof in profile.get("profiles") or []:
        samples = prof.get("samples") or []
        weights = prof.get("weights") or [1.0] * len(samples)
        for stack, w in zip(samples, weights, strict=False):
            total += w
            mine = ours.intersection(stack)
            if mine:
                hit += w
            for i in mine:
                per_frame[i] = per_frame.get(i, 0.0) + w
    top = sorted(per_frame.items(), key=lambda kv: -kv[1])[:5]
    return {
        "samples": total,
        "agentkv_share": hit / total if total else None,
        "top_agentkv_frames": [
            {
                "frame": f"{frames[i].get('name')} ({frames[i].get('file')}:{frames[i].get('line')})",
                "share": w / total,
            }
            for i, w in top
        ],
    }


def _ms(xs: Sequence[float]) -> dict[str, float | None]:
    return {
        "median_ms": statistics.median(xs) * 1000 if xs else None,
        "min_ms": min(xs) * 1000 if xs else None,
        "max_ms": max(xs) * 1000 if xs else None,
        "n": len(xs),
    }


def build_report(
    *,
    command: str,
    machine: Mapping[str, Any],
    options: Mapping[str, Any],
    phases: Sequence[Mapping[str, Any]],
    profiles: Mapping[str, Any] | None = None,
    resamples: int = 2000,
    seed: int = 0,
) -> dict[str, Any]:
    """``phases``: in run order, each {"round", "config", "latencies_s", ...}."""
    rounds = sorted({int(p["round"]) for p in phases})
    by = {(int(p["round"]), str(p["config"])): list(p["latencies_s"]) for p in phases}
    full = [r for r in rounds if (r, A) in by and (r, B) in by]
    a_ph, b_ph = [by[(r, A)] for r in full], [by[(r, B)] for r in full]
    ci = bootstrap_ratio(a_ph, b_ph, resamples=resamples, seed=seed)
    return {
        "schema": SCHEMA,
        "command": command,
        "machine": dict(machine),
        "options": dict(options),
        "method": "phased: one server at a time, ABBA order, ratio of medians of end-to-end "
        "plain-request latency (agentkv / vanilla), two-level bootstrap interval",
        "ratio": ci.to_dict(),
        "verdict": verdict(ci, phases),
        "target": f"<= {TARGET_RATIO}",
        "per_round_ratio": per_round_ratios(a_ph, b_ph),
        "vanilla": _ms(_flat(a_ph)),
        "agentkv": _ms(_flat(b_ph)),
        "phases": [dict(p) for p in phases],
        "profiles": dict(profiles or {}),
        # None: the phases ran without the step probe (--step-times).
        "step_times": step_probe.compare_step_times(phases)
        if any("step_times" in p for p in phases)
        else None,
    }


def to_markdown(report: Mapping[str, Any]) -> str:
    o, r = report["options"], report["ratio"]

    def f(x: Any, spec: str = ".3f") -> str:
        return "-" if x is None else format(x, spec)

    lines = [
        "# agentkv bench overhead (phased)",
        "",
        f"`{report['command']}`",
        "",
        f"{o.get('rounds')} rounds x 2 phases (ABBA), {o.get('requests')} sequential plain "
        f"requests per phase ({o.get('prompt_tokens')}-token prompt, {o.get('output_tokens')} "
        f"tokens, no trajectory), model `{o.get('preset')}`; one server up at a time.",
        "",
    ]
    base = Baseline(o.get("baseline", Baseline.VANILLA.value))
    if base is not Baseline.VANILLA:
        lines += [
            f"Baseline, in the columns and rows named vanilla: {BASELINE_TEXT[base]} "
            f"(`--baseline {base.value}`).",
            "",
        ]
    lines += [
        "| | vanilla | agentkv |",
        "|---|---:|---:|",
    ]
    for k in ("median_ms", "min_ms", "max_ms", "n"):
        fmt = "d" if k == "n" else ".1f"
        lines.append(f"| {k} | {f(report['vanilla'][k], fmt)} | {f(report['agentkv'][k], fmt)} |")
    lines += [
        "",
        f"agentkv / vanilla, ratio of medians: **{f(r['ratio'])}** "
        f"({int(r['level'] * 100)}% bootstrap interval {f(r['lo'])} - {f(r['hi'])}, "
        f"{r['resamples']} resamples over {r['rounds']} rounds); target {report['target']}: "
        f"{report['verdict']}.",
        "",
        "Per round: " + ", ".join(f(x) for x in report["per_round_ratio"]),
        "",
    ]
    busy = [
        b for p in report.get("phases") or [] if isinstance(b := p.get("other_cores_busy"), float)
    ]
    if busy:
        lines += [
            f"Other processes' CPU during the phases: {min(busy):.2f}-{max(busy):.2f} cores "
            f"(of {report['machine'].get('cpus', '?')}).",
            "",
        ]
    if report.get("step_times") is not None:
        lines += [*step_probe.step_times_markdown(report["step_times"]), ""]
    for name, prof in (report.get("profiles") or {}).items():
        if prof.get("status") != "ok":
            lines.append(f"py-spy profile, {name}: {prof.get('status')}")
            continue
        share = prof.get("agentkv_share")
        lines.append(
            f"py-spy profile, {name}: `{prof['file']}`, {prof.get('samples', 0):.0f} samples, "
            f"{'-' if share is None else f'{share * 100:.2f}%'} with an agentkv frame on the stack"
        )
        for fr in prof.get("top_agentkv_frames") or []:
            lines.append(f"  - {fr['share'] * 100:.2f}% {fr['frame']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- driving servers


@dataclass
class PhasedOptions:
    rounds: int = 6
    requests: int = 30
    warmup: int = 3
    prompt_tokens: int = 200
    output_tokens: int = 16
    preset: str = "tiny"
    num_blocks: int = 256
    kv_space_gib: int = 1
    host_capacity_gib: float = 2.0
    max_model_len: int = 4096
    seed: int = 0
    resamples: int = 2000
    profile_s: float = 0.0  # > 0: py-spy records each configuration's engine core this long
    # Time vLLM's engine-core and worker methods (agentkv_bench.step_probe).
    step_times: bool = False
    baseline: Baseline = Baseline.VANILLA
    ready_timeout_s: float = 600.0
    out: Path = Path("bench/results/overhead")
    # The same as ``bench scale``: one OMP thread for the model, a core for the rest.
    extra_env: dict[str, str] = field(default_factory=lambda: {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
    command: str = "agentkv bench overhead"


def _engine_core_pid(server_pid: int) -> int | None:
    """The engine core process of a server (a child named VLLM::EngineCore), by /proc."""
    import os

    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:
                stat = fh.read()
            with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == server_pid and (b"EngineCore" in cmd or "EngineCore" in stat):
            return int(entry.name)
    return None


def profile_engine(
    server_pid: int, seconds: float, out: Path, load: Callable[[], object]
) -> dict[str, Any]:
    """py-spy record of the engine core (subprocesses included: the worker) for ``seconds``
    while ``load()`` keeps sending plain requests, as a speedscope JSON. Runs after the phase's
    measured requests (the sampler takes CPU: it must not be inside a timed phase). Returns the
    file and its ``profile_summary``, or why there is none (never raises: a profile is an
    extra)."""
    # The venv's own py-spy when the bench runs as .venv/bin/agentkv without the venv on PATH.
    beside = Path(sys.executable).parent / "py-spy"
    spy = shutil.which("py-spy") or (str(beside) if beside.is_file() else None)
    if spy is None:
        return {"status": "py-spy not installed"}
    pid = _engine_core_pid(server_pid)
    if pid is None:
        return {"status": "engine core process not found"}
    argv = [spy, "record", "-p", str(pid), "--subprocesses", "-d", str(max(1, int(seconds)))]
    argv += ["-f", "speedscope", "-o", str(out), "--nonblocking"]
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except OSError as exc:
        return {"status": f"py-spy failed to start: {exc}"}
    while proc.poll() is None:
        load()
    err = (proc.stderr.read() if proc.stderr else b"").decode(errors="replace")[-300:]
    if proc.returncode != 0 or not out.is_file():
        return {"status": f"py-spy failed ({proc.returncode}): {err.strip()}"}
    try:
        summary = profile_summary(json.loads(out.read_text()))
    except (OSError, ValueError) as exc:
        return {"status": "ok", "file": str(out), "summary_error": str(exc)}
    return {"status": "ok", "file": str(out), **summary}


def run_phased(opts: PhasedOptions, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Run the ABBA phases, write report.json / report.md into ``opts.out``, return the report.
    Raises agentkv.errors.EngineUnavailableError when a server cannot start."""
    import httpx

    from agentkv import modelgen
    from agentkv.launch import running_server
    from agentkv_bench.runner import machine_info
    from agentkv_bench.scale import CpuMeter, ScaleOptions, plain_latencies

    say = reporter(progress)

    opts.out.mkdir(parents=True, exist_ok=True)
    say(f"building model preset {opts.preset}")
    model_dir = str(modelgen.ensure_model(opts.preset))
    work = Path(tempfile.mkdtemp(prefix="agentkv-bench-overhead-"))
    req = ScaleOptions(prompt_tokens=opts.prompt_tokens, output_tokens=opts.output_tokens)
    rng = random.Random(opts.seed)
    phases: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}
    order = phase_order(opts.rounds)
    for i, (r, name) in enumerate(order):
        probe_dir = work / f"probe-{name}-{r}" if opts.step_times else None
        spec = _phase_spec(opts, model_dir, work, name, r, probe_dir)
        say(f"round {r}: {name}: starting vLLM", i, len(order))
        with (
            running_server(spec, ready_timeout_s=opts.ready_timeout_s) as server,
            httpx.Client(timeout=httpx.Timeout(600.0, connect=30.0)) as client,
        ):
            base, model = server.base_url, server.model
            plain_latencies(client, base, model, req, rng, opts.warmup)
            meter = CpuMeter(server.proc.pid)
            window_start = time.monotonic()
            m0, t0 = meter.read(), time.perf_counter()
            lat = plain_latencies(
                client,
                base,
                model,
                req,
                rng,
                opts.requests,
                functools.partial(say, f"round {r}: {name}: plain requests", total=opts.requests),
            )
            wall = time.perf_counter() - t0
            m1 = meter.read()
            window_end = time.monotonic()
            if probe_dir is not None:  # untimed: the probe writes in batches; these flush it
                plain_latencies(client, base, model, req, rng, FLUSH_REQUESTS)
            if opts.profile_s > 0 and r == 0:
                say(f"{name}: py-spy profile of the engine core", 0, 0)
                profiles[name] = profile_engine(
                    server.proc.pid,
                    opts.profile_s,
                    opts.out / f"pyspy-{name}.speedscope.json",
                    functools.partial(plain_latencies, client, base, model, req, rng, 1),
                )
        phase: dict[str, Any] = {
            "round": r,
            "config": name,
            "latencies_s": lat,
            "wall_s": wall,
            "other_cores_busy": CpuMeter.cores(m0, m1, wall),
        }
        if probe_dir is not None:
            records = step_probe.read_records(probe_dir)
            phase["step_times"] = step_probe.phase_step_times(records, window_start, window_end)
        phases.append(phase)
    say("writing the report")
    report = build_report(
        command=opts.command,
        machine=machine_info(),
        options={
            k: (str(v) if isinstance(v, Path) else v.value if isinstance(v, Enum) else v)
            for k, v in asdict(opts).items()
            if k not in ("command",)
        },
        phases=phases,
        profiles=profiles,
        resamples=opts.resamples,
        seed=opts.seed,
    )
    (opts.out / "report.json").write_text(json.dumps(report, indent=1))
    (opts.out / "report.md").write_text(to_markdown(report))
    return report


def _phase_spec(
    opts: PhasedOptions,
    model_dir: str,
    work: Path,
    name: str,
    r: int,
    probe_dir: Path | None = None,
) -> LaunchSpec:
    """The server of one phase: vanilla (A: no connector) or agentkv (a host tier, no disk);
    ``probe_dir``: load the step probe, its records there."""
    import os

    from agentkv.launch import LaunchSpec

    env = {**opts.extra_env, "AGENTKV_PROFILE": str(work / "no-profile.json")}
    extra_args: list[str] = []
    if name == A and opts.baseline is Baseline.NULL_CONNECTOR:
        from agentkv_bench import null_connector

        transfer = {
            "kv_connector": null_connector.NAME,
            "kv_connector_module_path": null_connector.__name__,
            "kv_role": "kv_both",
        }
        extra_args = ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
    if probe_dir is not None:
        probe_dir.mkdir(parents=True, exist_ok=True)
        env.update(step_probe.probe_env(probe_dir, os.environ.get("PYTHONPATH")))

    return LaunchSpec(
        model=model_dir,
        connector_config=None
        if name == A
        else {"host_capacity_gib": opts.host_capacity_gib, "disk_dir": None},
        kv_space_gib=opts.kv_space_gib,
        num_blocks=opts.num_blocks,
        served_model_name=opts.preset,
        max_model_len=opts.max_model_len,
        extra_env=env,
        extra_args=extra_args,
        log_path=opts.out / f"server-{name}-{r}.log",
        run_dir=work / f"run-{name}-{r}",
    )
