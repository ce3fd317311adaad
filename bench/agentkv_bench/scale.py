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

Primitives: ``ScaleOptions``; ``run_scale(opts, progress?)`` starts the server, runs the phases and
writes report.json / report.md; ``measure_phase``, ``plain_latencies``, ``settled`` and
``CpuMeter`` are its parts (``phased.py`` reuses ``plain_latencies`` and ``CpuMeter``). The pure report math
(unit-tested: ``latency_stats``, ``phase_summary``, ``pooled``, ``bracketed``, ``ratios``,
``targets``, ``build_report``, ``to_markdown``) is ``scale_report.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from agentkv_bench import connector_cpu
from agentkv_bench.progress import ProgressFn, reporter
from agentkv_bench.scale_report import Phase, build_report, phase_summary, to_markdown
from agentkv_bench.workload import filler

if TYPE_CHECKING:
    from agentkv.launch import LaunchSpec

# Token ids for the plain prompts: above the embedded tokenizers' special tokens and byte
# alphabet, below their vocabulary size (8192).
TOKEN_LO, TOKEN_HI = 300, 8000
# Branch states that mean "still running, deciding or moving"; settled = none of these.
UNSETTLED_STATES = ("active", "held", "offloading")


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
    from agentkv.launch import running_server
    from agentkv_bench.runner import machine_info

    say = reporter(progress)

    opts.out.mkdir(parents=True, exist_ok=True)
    say(f"building model preset {opts.preset}")
    model_dir = str(modelgen.ensure_model(opts.preset))
    spec = _launch_spec(opts, model_dir)
    rng = random.Random(opts.seed)
    phases: list[Phase] = []
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

        idle = _run_rounds(client, base, model, opts, measure, say)
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


def _launch_spec(opts: ScaleOptions, model_dir: str) -> LaunchSpec:
    """The server run_scale starts: the host tier sized by ``opts``, no profile written."""
    from agentkv.launch import LaunchSpec

    work = Path(tempfile.mkdtemp(prefix="agentkv-bench-scale-"))
    return LaunchSpec(
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


def _run_rounds(
    client: httpx.Client,
    base: str,
    model: str,
    opts: ScaleOptions,
    measure: Callable[[str, int], None],
    say: ProgressFn,
) -> list[dict[str, Any]]:
    """The phases: none, then per round create, settle, held, delete, settle, deleted; returns
    each round's idle-trajectory timings."""
    idle: list[dict[str, Any]] = []
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
    return idle


__all__ = [
    "CpuMeter",
    "ProgressFn",
    "ScaleOptions",
    "measure_phase",
    "plain_latencies",
    "plain_prompt",
    "run_scale",
    "settled",
]
