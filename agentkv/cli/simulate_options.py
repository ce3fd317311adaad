"""The options of ``agentkv simulate`` (typer ``Annotated`` aliases; the defaults are in the
command's signature, simulate.py). One alias per option, named after its parameter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agentkv.cli.simulate_workload import BENCH_TOKEN_SCALE

Trajectories = Annotated[
    int | None,
    typer.Option(
        "--trajectories", "-n", min=1, help="Trajectories of the bench workload (default 6)."
    ),
]
Turns = Annotated[
    int | None,
    typer.Option(
        "--turns", "-t", min=1, help="Turns per trajectory of the bench workload (default 5)."
    ),
]
ForkProb = Annotated[
    float | None,
    typer.Option(
        "--fork-prob",
        min=0.0,
        max=1.0,
        help="Bench workload: chance that a turn after the first forks into --fork-width "
        "branches sharing the trajectory's history (as `bench agents --fork-prob`; default 0).",
    ),
]
ForkWidth = Annotated[
    int | None,
    typer.Option("--fork-width", min=2, help="Branches of a fork (default 2)."),
]
Trace = Annotated[
    Path | None,
    typer.Option(
        "--trace",
        exists=True,
        dir_okay=False,
        help="Simulate a recorded trace (TraceLab session CSV, canonical CSV or round JSONL, "
        "as `bench agents --trace`) instead of the bench's generator.",
    ),
]
Sessions = Annotated[
    int | None,
    typer.Option(
        "--sessions", min=1, help="With --trace: only the first N sessions (as `bench agents`)."
    ),
]
TimeScale = Annotated[
    float | None,
    typer.Option(
        "--time-scale",
        min=0.0,
        help="Multiplies every tool wait (bench generator default 0.1, as `bench agents`; "
        "traces default 1.0) and the start stagger.",
    ),
]
TokenScale = Annotated[
    float | None,
    typer.Option(
        "--token-scale",
        min=0.0,
        help=f"Multiplies every token count (bench generator default {BENCH_TOKEN_SCALE}: the "
        "embedded tokenizer's real tokens per target token, chat template included; traces 1.0).",
    ),
]
Seed = Annotated[
    int, typer.Option("--seed", help="Workload seed (and Poisson arrivals with --rate).")
]
NumBlocks = Annotated[
    int | None,
    typer.Option(
        "--num-blocks",
        min=1,
        help="Device KV blocks per replica (default 128, as `bench agents`; with --gpu, what "
        "the GPUs hold after the weights at 0.9 utilization).",
    ),
]
Gpu = Annotated[
    str | None,
    typer.Option(
        "--gpu",
        help="Engine costs from published figures instead of a calibration: H100 or H200 "
        "(with --model and --tp; docs/simulate.md lists the sources).",
    ),
]
ModelName = Annotated[
    str,
    typer.Option(
        "--model", help="With --gpu: llama-3.1-8b, llama-3.1-70b (GQA) or deepseek-v2-lite (MLA)."
    ),
]
Tp = Annotated[
    int, typer.Option("--tp", min=1, help="With --gpu: GPUs per replica (tensor parallel).")
]
HostCapacityGib = Annotated[
    float, typer.Option("--host-capacity-gib", min=0.0, help="Host tier per replica (0: none).")
]
DiskCapacityGib = Annotated[
    float, typer.Option("--disk-capacity-gib", min=0.0, help="Disk tier per replica (0: none).")
]
RemoteCapacityGib = Annotated[
    float,
    typer.Option(
        "--remote-capacity-gib",
        min=0.0,
        help="A remote tier shared by every replica (0: none); offloads also go there, and a "
        "turn routed to another replica loads from it.",
    ),
]
Replicas = Annotated[int, typer.Option("--replicas", "-r", min=1, help="Replicas in the fleet.")]
Router = Annotated[
    str,
    typer.Option(
        "--router",
        help="round-robin, session-affinity, least-loaded, kv-aware (vllm-router's cost with "
        "tier credits), affinity-load (the reference's mu/gamma objective); a comma list or "
        "'all' compares them.",
    ),
]
Policy = Annotated[
    str,
    typer.Option(
        "--policy",
        help="vanilla (prefix cache only), agentkv (agentkv's own decide/predict), "
        "retain-always (TTL pinning, Continuum-like), offload-always; a comma list or 'all'.",
    ),
]
Mu = Annotated[
    float, typer.Option("--mu", min=0.0, max=1.0, help="affinity-load: weight of the match.")
]
Gamma = Annotated[float, typer.Option("--gamma", min=0.01, help="affinity-load: load exponent.")]
RetainTtlS = Annotated[
    float,
    typer.Option(
        "--retain-ttl", min=0.0, help="retain-always: seconds a paused trajectory is pinned."
    ),
]
Calibration = Annotated[
    Path | None,
    typer.Option(
        "--calibration",
        exists=True,
        dir_okay=False,
        help="Engine costs: a simulator calibration JSON, an `agentkv calibrate` profile "
        "(bandwidths, prefill rate) or a `bench agents` report (a rough rate from its vanilla run). "
        "Default: the bench's engine (small model, 2-core CPU VM).",
    ),
]
Rate = Annotated[
    float | None,
    typer.Option(
        "--rate",
        min=0.0,
        help="Start trajectories as a Poisson process of this many per second (instead of the "
        "bench's stagger or the trace's arrival times).",
    ),
]
Find = Annotated[
    bool,
    typer.Option(
        "--find-replicas",
        help="Search the smallest replica count meeting --slo-ttft-p99, per router and policy.",
    ),
]
SloTtftP99 = Annotated[
    float | None,
    typer.Option(
        "--slo-ttft-p99", min=0.0, help="TTFT p99 objective (s, all turns) for the search."
    ),
]
MaxReplicas = Annotated[int, typer.Option("--max-replicas", min=1, help="Search limit.")]
CompareWith = Annotated[
    Path | None,
    typer.Option(
        "--compare",
        exists=True,
        dir_okay=False,
        help="A measured run (tests/unit/fixtures/simulate/*.json or a bench report.json): "
        "prints simulated vs measured with relative errors.",
    ),
]
Admission = Annotated[
    str,
    typer.Option(
        "--admission",
        help="whole: a request waits until its prompt and output fit (validated default); "
        "chunk: vLLM 0.32's scheduler (admit when the prompt fits, allocate chunk by chunk, "
        "preempt the newest request by recompute when a running one needs a block).",
    ),
]
WritebackMode = Annotated[
    str,
    typer.Option(
        "--writeback",
        help="forecast (the connector's default): agentkv's offload_host copies wait in vLLM's "
        "cache until the pool forecasts their eviction; eager: copy at the pause (the connector "
        "before issue 26, what the bench run in docs/results.md used).",
    ),
]
GraceS = Annotated[
    float | None,
    typer.Option(
        "--grace-s",
        min=0.0,
        help="The connector's grace_s (default: the connector's default, 0.5 s): a finished "
        "turn's blocks stay pinned this long waiting for the harness's pause (agentkv, "
        "retain-always, offload-always).",
    ),
]
PauseAfter = Annotated[
    str,
    typer.Option(
        "--pause-after",
        help="When the harness's pause arrives after a turn's answer, in seconds (0: at once, "
        "as the bench and trace harnesses do), or 'never' (a harness without agentkv's SDK: "
        "each turn's blocks get the connector's default action when the grace ends).",
    ),
]
DevicePrefetch = Annotated[
    bool,
    typer.Option(
        "--device-prefetch",
        help="agentkv prefetches offloaded contexts back into device blocks at the predicted "
        "return, by the manager's rule (agentkv.prefetch_rule; the connector's device_prefetch).",
    ),
]
Full = Annotated[
    bool,
    typer.Option(
        "--full",
        help="Simulate an unbounded overload to its end (default: stop after ten median "
        "trajectories, report the utilization, a warning and the smallest fleet that carries it).",
    ),
]
Plot = Annotated[Path | None, typer.Option("--plot", help="Write PNG plots into this folder.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the results as JSON on stdout.")]
