"""The options of ``agentkv decide`` and ``agentkv calibrate`` (typer ``Annotated`` aliases; the
defaults are in the commands' signatures, policy.py). One alias per option, named after its
parameter; ``Calibrate*`` aliases are calibrate's where both commands have an option of that name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

# ---------------------------------------------------------------------------------- decide

Tokens = Annotated[int, typer.Option("--tokens", help="Tokens S of the paused trajectory.")]
Model = Annotated[
    Path | None,
    typer.Option(
        "--model",
        help="HF config.json (or its folder) of the served model: gives KV bytes, parameters, "
        "layers and hidden size. Excludes --kv-bytes.",
    ),
]
KvDtype = Annotated[
    str | None,
    typer.Option("--kv-dtype", help="KV element type with --model: bf16, fp16, fp8, int8, fp32."),
]
Tp = Annotated[
    int, typer.Option("--tp", min=1, help="Tensor parallel ranks with --model: KV bytes per rank.")
]
KvBytes = Annotated[
    str | None,
    typer.Option("--kv-bytes", help="KV bytes M held by the trajectory (10.7GB, 5GiB, 1e10)."),
]
Params = Annotated[
    float | None,
    typer.Option(
        "--params",
        help="Model parameters P (70.6e9); needed with --prefill-flops unless --model gives it.",
    ),
]
PrefillFlops = Annotated[
    float | None,
    typer.Option(
        "--prefill-flops",
        help="Sustained prefill FLOP/s R: recompute = (2PS + 4LS^2d)/R. Excludes "
        "--prefill-tokens-per-s.",
    ),
]
PrefillTokensPerS = Annotated[
    float | None,
    typer.Option(
        "--prefill-tokens-per-s",
        help="Measured prefill tokens/s T (agentkv calibrate --server): recompute = S/T.",
    ),
]
Link = Annotated[
    str,
    typer.Option(
        "--link-bytes-per-s",
        help="Device<->host bandwidth B per second (512e9, 50GB, 25GiB): reload = M/B.",
    ),
]
Wait = Annotated[
    float,
    typer.Option("--wait", help="Expected tool wait W in seconds (inf for 'indefinitely')."),
]
Pressure = Annotated[
    float,
    typer.Option(
        "--pressure",
        help="Device KV pool use U in [0, 1]. Default 1: a constrained pool, where T* equals the "
        "round trip as in the reference's worked examples.",
    ),
]
DiskWrite = Annotated[
    str | None,
    typer.Option(
        "--disk-write-bytes-per-s",
        help="Disk write bandwidth per second; with --disk-read-bytes-per-s enables the disk tier.",
    ),
]
DiskRead = Annotated[
    str | None, typer.Option("--disk-read-bytes-per-s", help="Disk read bandwidth per second.")
]
HostFree = Annotated[
    str | None,
    typer.Option("--host-free", help="Free bytes in the host tier (default: unlimited)."),
]
DiskFree = Annotated[
    str | None,
    typer.Option("--disk-free", help="Free bytes in the disk tier (default: unlimited)."),
]
AsJson = Annotated[
    bool, typer.Option("--json", help="Print the decision as JSON on stdout (nothing else).")
]

# ---------------------------------------------------------------------------------- calibrate

DiskDir = Annotated[
    Path | None,
    typer.Option(
        "--disk-dir",
        help="Directory to measure disk write/read in (use the disk tier's directory). "
        "Default: the profile's directory.",
    ),
]
NoDisk = Annotated[bool, typer.Option("--no-disk", help="Skip the disk measurement.")]
Server = Annotated[
    str | None,
    typer.Option(
        "--server",
        help="OpenAI-compatible server URL (http://127.0.0.1:8000) to measure prefill tokens/s.",
    ),
]
CalibrateModel = Annotated[
    str | None,
    typer.Option("--model", help="Served model name for --server (default: the first listed)."),
]
ApiKey = Annotated[
    str | None,
    typer.Option("--api-key", envvar="AGENTKV_API_KEY", help="API key for --server."),
]
PromptTokens = Annotated[
    int,
    typer.Option(
        "--prompt-tokens", help="Length of the long prefill prompt (capped by the model)."
    ),
]
Size = Annotated[
    str,
    typer.Option("--size", help="Buffer and disk file size per measurement (256MiB, 1GiB)."),
]
Output = Annotated[
    Path | None,
    typer.Option(
        "--output",
        "-o",
        help="Where to write the profile. Default: $AGENTKV_PROFILE or "
        "~/.cache/agentkv/profile.json.",
    ),
]
NoSave = Annotated[bool, typer.Option("--no-save", help="Measure and print; write nothing.")]
CalibrateAsJson = Annotated[
    bool,
    typer.Option("--json", help="Print the profile as JSON on stdout (progress goes to stderr)."),
]
Load = Annotated[
    bool,
    typer.Option(
        "--load",
        help="With --server: measure the engine under load (prefill vs chunk and context, "
        "decode step vs batch and context, admission) and write an engine profile for "
        "`agentkv simulate --calibration` (docs/simulate.md) to --output.",
    ),
]
MaxBatchedTokens = Annotated[
    int,
    typer.Option("--max-batched-tokens", help="With --load: the server's max_num_batched_tokens."),
]
Quick = Annotated[
    bool,
    typer.Option("--quick", help="With --load: short prompts and small batches (minutes)."),
]
