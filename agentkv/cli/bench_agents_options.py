"""The options of ``agentkv bench agents`` (typer ``Annotated`` aliases; the defaults are in the
command's signature, bench_agents.py). One alias per option, named after its parameter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Preset = Annotated[
    str | None,
    typer.Option(
        "--preset", help="Embedded model: small (default; recompute is expensive) or tiny."
    ),
]
Trajectories = Annotated[
    int | None,
    typer.Option("--trajectories", "-n", min=1, help="Concurrent trajectories (default 6)."),
]
Turns = Annotated[
    int | None, typer.Option("--turns", "-t", min=1, help="Turns per trajectory (default 5).")
]
TimeScale = Annotated[
    float | None,
    typer.Option(
        "--time-scale",
        min=0.0,
        help="Multiplies every tool wait (compile ~3 s, test suite ~30 s, human approval ~180 s "
        "medians) and the start stagger. Default 0.1. With --trace: multiplies the trace's "
        "arrival times and tool waits (default 1).",
    ),
]
Trace = Annotated[
    Path | None,
    typer.Option(
        "--trace",
        exists=True,
        dir_okay=False,
        readable=True,
        help="Replay this recorded workload instead of the generated one: TraceLab session CSV "
        "(session_id,arrival_time,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms), "
        "its canonical form (id,input_len,...,prefix_len) or round-trace JSONL (.gz read too); "
        "the format is detected. A closed loop per session (send a round, read the whole reply, "
        "wait tool_wait_after_ms, send the next), prompts as token ids whose prefix is the "
        "session's history. Runs vanilla vLLM, agentkv and an oracle (vanilla with enough "
        "blocks that nothing is evicted) and takes each resume stall apart.",
    ),
]
TokenScale = Annotated[
    float,
    typer.Option(
        "--token-scale",
        min=0.0001,
        help="With --trace: multiplies every prefix, input and output length (fit the machine).",
    ),
]
Sessions = Annotated[
    int | None,
    typer.Option("--sessions", min=1, help="With --trace: replay only the first N sessions."),
]
Seed = Annotated[int, typer.Option("--seed", help="Workload seed: same seed, same workload.")]
ForkProb = Annotated[
    float | None,
    typer.Option("--fork-prob", min=0.0, max=1.0, help="Chance that a turn forks into 2 branches."),
]
NumBlocks = Annotated[
    str | None,
    typer.Option(
        "--num-blocks",
        help="Device KV blocks (128 tokens each), the same for every configuration but the "
        "oracle; small enough that paused trajectories do not all fit (default 128). With "
        "--trace: default a quarter of the oracle's, at least two of the longest context. A "
        "comma-separated list (e.g. 96,48,24: roomy, tight, very tight) sweeps the pool size: "
        "each size is a full run of every configuration, reported side by side in sweep.md.",
    ),
]
Configs = Annotated[
    str | None,
    typer.Option(
        "--configs",
        help="Configurations to run, comma-separated, in this order: vanilla, agentkv, "
        "retain-always and offload-always (the agentkv connector taking that one action at "
        "every pause: fixed policies), oracle (vanilla vLLM with a pool that never evicts, run "
        "once), connector-only (the agentkv server driven by plain requests, no trajectory: "
        "what the connector alone costs, a diagnostic). Default vanilla,agentkv (with --trace vanilla,agentkv,oracle). Given, or with "
        "several --num-blocks, the run is a sweep: sweep.md gives every metric per configuration "
        "and pool size and agentkv's regret against the best fixed policy.",
    ),
]
Repeats = Annotated[
    int,
    typer.Option(
        "--repeats",
        min=1,
        help="Run every configuration N times per pool size (default 1). On a small shared "
        "machine one run per cell scatters by more than the 5% the targets ask to resolve "
        "(identical work has shown resume TTFT p50 from 0.067 to 0.152 s), and the server that "
        "runs first after a pause may be slower: repeats alternate the order (the given order, "
        "then reversed, then given: ABBA, so an order effect falls on every configuration). "
        "sweep.md then shows each cell as the median over the repeats with their min-max, "
        "computes regret and targets from the medians, and gives agentkv / vanilla per repeat; "
        "sweep.json keeps every raw value. Each repeat's full report goes to "
        "<out>/pool-<N>/rep-<k>/. N > 1 makes even a single pool size a sweep; the oracle "
        "still runs once.",
    ),
]
HostCapacityGib = Annotated[
    float, typer.Option("--host-capacity-gib", min=0.1, help="agentkv host tier size.")
]
Disk = Annotated[
    bool,
    typer.Option(
        "--disk",
        help="agentkv configurations offload every pause to the disk tier (a reload is a disk "
        "read, so what device prefetch saves shows on CPU too).",
    ),
]
Prefetch = Annotated[
    bool,
    typer.Option(
        "--prefetch/--no-prefetch",
        help="Device prefetch in the agentkv configurations (docs/prefetch.md): the report's "
        "prefetch section gives its on-time rate and the TTFT of on-time resumes against the "
        "oracle's device hits on the same turns (add oracle to --configs).",
    ),
]
PauseViaOpt = Annotated[
    str,
    typer.Option(
        "--pause-via",
        help="How the trajectory driver pauses a session for a tool wait. routes (default): "
        "POST .../pause after the reply and POST .../resume after the wait, the harness SDK's "
        "tool() calls. request: the request before each wait carries "
        "kv_transfer_params.agentkv.pause_after (the SDK's complete(then_tool=...)) and the "
        "next request resumes, no control call per wait (an agent that knows its next step is "
        "a tool). The generated workload's fork turns keep the routes for the wait after them.",
    ),
]
Out = Annotated[
    Path | None,
    typer.Option(
        "--out",
        help="Folder for report.json, report.md, PNGs, logs (default bench/results/agents, "
        "with --trace bench/results/trace).",
    ),
]
Quick = Annotated[
    bool,
    typer.Option(
        "--quick",
        help="CI smoke run: tiny model, 3 trajectories x 3 turns, sub-second waits, no "
        "overhead benchmark. Checks completion and a well-formed report, not the targets. "
        "With --trace: the tiny model (the trace's sizes as given).",
    ),
]
SkipOverhead = Annotated[
    bool,
    typer.Option("--skip-overhead", help="Skip the no-pause overhead run (`vllm bench serve`)."),
]
Overhead = Annotated[
    bool, typer.Option("--overhead", help="Run the overhead benchmark even with --quick.")
]
AsJson = Annotated[
    bool, typer.Option("--json", help="Print the summary and targets as JSON on stdout.")
]
