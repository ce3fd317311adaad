"""``agentkv model``: build the embedded random-weight model (no hub)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from agentkv.cli.common import fail

model_app = typer.Typer(
    help="The embedded random-weight model used by the demo, tests and benchmarks.",
    no_args_is_help=True,
)


@model_app.command("build-tiny")
def build_tiny(
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Folder to write the model into. Default: the user cache ($AGENTKV_CACHE_DIR or ~/.cache/agentkv/models/PRESET-rN).",
    ),
    preset: str = typer.Option(
        "tiny",
        "--preset",
        help="'tiny' (~20M params, fast start; tests and demo) or 'small' (~150M params; 8k-token prefill costs seconds on 2 CPU cores, for benchmarks).",
    ),
    force: bool = typer.Option(
        False, "--force", help="Rebuild even when a complete build is already there."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Build (or reuse) a seeded random-weight Llama model plus an offline-trained byte-level BPE tokenizer with a chat template."""
    from agentkv import modelgen
    from agentkv.errors import ConfigError

    start = time.perf_counter()
    try:
        spec = modelgen.get_preset(preset)
        target = out if out is not None else modelgen.default_model_dir(preset)
        reused = not force and modelgen.is_complete(target, spec)
        if not reused:
            if not as_json:
                typer.echo(f"building {preset} model into {target} ...", err=True)
            modelgen.build_model(preset, target)
    except ConfigError as exc:
        fail(str(exc))
    meta = modelgen.read_marker(target)
    result = {
        "path": str(target),
        "preset": preset,
        "reused": reused,
        "weights_xxh3_128": meta.get("weights_xxh3_128"),
        "seconds": round(time.perf_counter() - start, 2),
    }
    if as_json:
        typer.echo(json.dumps(result))
    else:
        typer.echo(
            f"{'reused' if reused else 'built'} {preset} model at {target} (weights {result['weights_xxh3_128']}, {result['seconds']} s)"
        )


def register(app: typer.Typer) -> None:
    app.add_typer(model_app, name="model")
