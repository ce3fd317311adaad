"""The options of ``agentkv size`` and ``agentkv plan`` (typer ``Annotated`` aliases; the
defaults are in the commands' signatures, size.py). ``Size*`` for size, ``Plan*`` for plan.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

# ---- size

SizeConfig = Annotated[Path, typer.Argument(help="Model folder or its HF config.json.")]
SizeContext = Annotated[
    str,
    typer.Option(
        "--context", "-c", help="Comma-separated context lengths in tokens, each sized separately."
    ),
]
SizeKvDtype = Annotated[
    str | None,
    typer.Option(
        "--kv-dtype",
        help="KV element dtype: bf16, fp16, fp8, int8, fp32 (default: the config's dtype).",
    ),
]
SizeTp = Annotated[
    int,
    typer.Option("--tp", help="Tensor-parallel degree (KV heads per device = max(1, H_kv // TP))."),
]
SizeGpu = Annotated[
    str | None, typer.Option("--gpu", help="GPU preset: H100, H200, B200, A100-80GB, L40S, MI300X.")
]
SizeGpus = Annotated[
    int | None, typer.Option("--gpus", help="Number of devices in the deployment (default: --tp).")
]
SizeHbmBytes = Annotated[
    str | None,
    typer.Option(
        "--hbm-bytes",
        help="Device memory summed over all --gpus devices, e.g. 687.2GB (instead of --gpu).",
    ),
]
SizeWeightsBytes = Annotated[
    str | None,
    typer.Option(
        "--weights-bytes",
        help="Weight bytes over all devices (default: parameters x weight dtype, one copy per TP group).",
    ),
]
SizeRuntimeBytes = Annotated[
    str | None,
    typer.Option(
        "--runtime-bytes",
        help="Runtime reserve (activations, CUDA context) over all devices (default: 10% of device memory).",
    ),
]
SizePoolBytes = Annotated[
    str | None,
    typer.Option(
        "--pool-bytes",
        help="KV pool over all devices, e.g. 526e9 or 480GiB (skips the memory arithmetic).",
    ),
]
SizeHeadroom = Annotated[
    float,
    typer.Option(
        "--headroom", help="Fraction of the pool kept free as allocator headroom, in [0, 1)."
    ),
]
SizeOutputTokens = Annotated[
    int,
    typer.Option("--output-tokens", help="Tokens each trajectory generates on top of its context."),
]
SizeSharedTokens = Annotated[
    int,
    typer.Option(
        "--shared-tokens",
        help="Tokens of each context that are a common prefix held once (equation 7).",
    ),
]
SizeBlockSize = Annotated[
    int, typer.Option("--block-size", help="Paged KV block size in tokens (tail waste (B-1)/2).")
]
SizeStaticMaxTokens = Annotated[
    int | None,
    typer.Option(
        "--static-max-tokens",
        help="Worst-case reservation per request for the static-allocation comparison (default: max_position_embeddings).",
    ),
]
SizeSequences = Annotated[
    int | None,
    typer.Option(
        "--sequences",
        help="Concurrent sequences for the tail-waste estimate (default: max trajectories per context).",
    ),
]
SizeAsJson = Annotated[
    bool, typer.Option("--json", help="Print machine-readable JSON only, on stdout.")
]
# ---- plan

PlanConfig = Annotated[Path, typer.Argument(help="Model folder or its HF config.json.")]
PlanContext = Annotated[int, typer.Option("--context", "-c", help="Context tokens per trajectory.")]
PlanTrajectories = Annotated[
    int | None,
    typer.Option(
        "--trajectories",
        "-n",
        help="Concurrent trajectories to hold (or give the tool-wait profile).",
    ),
]
PlanArrivalRate = Annotated[
    float | None,
    typer.Option(
        "--arrival-rate", help="Trajectory turns started per second (lambda, for Little's law)."
    ),
]
PlanGenSeconds = Annotated[
    float, typer.Option("--gen-seconds", help="Seconds a turn spends generating (T_gen).")
]
PlanToolSeconds = Annotated[
    float, typer.Option("--tool-seconds", help="Seconds a turn waits on its tool (T_tool).")
]
PlanKvDtype = Annotated[
    str | None, typer.Option("--kv-dtype", help="KV element dtype: bf16, fp16, fp8, int8, fp32.")
]
PlanGpu = Annotated[
    str | None, typer.Option("--gpu", help="GPU preset: H100, H200, B200, A100-80GB, L40S, MI300X.")
]
PlanHbmBytesPerGpu = Annotated[
    str | None, typer.Option("--hbm-bytes-per-gpu", help="Memory of one GPU (instead of --gpu).")
]
PlanRuntimeBytesPerGpu = Annotated[
    str | None,
    typer.Option(
        "--runtime-bytes-per-gpu", help="Runtime reserve on each GPU (default: 10% of its memory)."
    ),
]
PlanWeightsBytes = Annotated[
    str | None,
    typer.Option(
        "--weights-bytes",
        help="Bytes of one copy of the weights (default: parameters x weight dtype).",
    ),
]
PlanTp = Annotated[
    int | None,
    typer.Option(
        "--tp", help="Tensor-parallel degree (default: try 1, 2, 4, 8 and pick the fewest GPUs)."
    ),
]
PlanPp = Annotated[int, typer.Option("--pp", help="Pipeline-parallel degree.")]
PlanGpusPerNode = Annotated[int, typer.Option("--gpus-per-node", help="GPUs in one node.")]
PlanHeadroom = Annotated[
    float, typer.Option("--headroom", help="Fraction of each pool kept free, in [0, 1).")
]
PlanOutputTokens = Annotated[
    int,
    typer.Option("--output-tokens", help="Tokens each trajectory generates on top of its context."),
]
PlanSharedTokens = Annotated[
    int,
    typer.Option(
        "--shared-tokens", help="Tokens of the context shared by all trajectories of a replica."
    ),
]
PlanAsJson = Annotated[
    bool, typer.Option("--json", help="Print machine-readable JSON only, on stdout.")
]
