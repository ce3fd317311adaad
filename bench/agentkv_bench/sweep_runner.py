"""Run a configuration x pool-size sweep: ``agentkv bench agents [--trace FILE] --configs ...
--num-blocks A,B,C``.

Primitives:
  run_agents_sweep(opts, pools, progress) -> the sweep report (synthetic workload)
  run_trace_sweep(opts, pools, progress)  -> the sweep report (a recorded trace)
  pool_summaries(report, configs)          {configuration: summary} of one single-pool report

Each pool size is one ordinary single-pool bench (``runner.run_bench`` /
``trace_runner.run_trace_bench``) with its full report in ``<out>/pool-<N>/``; every server runs
alone, one after another. The oracle (its pool computed from the workload, the same whatever the
swept size) runs once, with the first pool size. The capacity-equal bound (a simulation fitted to
the oracle run, ``agentkv.simulate.bounds``) is computed for every pool size of a trace sweep; the
synthetic workload has no simulator form, so its sweep has none. The sweep's own report
(``sweep.json``, ``sweep.md`` in ``<out>``) holds every metric per configuration and pool size,
agentkv's regret against the best fixed policy and the targets (``sweep``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from agentkv_bench.matrix import SPECS, BenchConfig
from agentkv_bench.progress import ProgressFn
from agentkv_bench.sweep import build_sweep, sweep_markdown

CONDITIONS = (
    "Every server ran alone, one after another, on this machine; ratios between configurations "
    "are the result (absolute times depend on the machine's other load)."
)


def _prefixed(progress: ProgressFn | None, prefix: str) -> ProgressFn | None:
    if progress is None:
        return None
    return lambda phase, done, total: progress(f"{prefix}{phase}", done, total)


def pool_summaries(report: Mapping[str, Any], configs: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The summaries of the non-oracle configurations of one single-pool report, in order."""
    cfgs = report["configs"]
    return {
        n: dict(cfgs[n]["summary"])
        for n in configs
        if n in cfgs and not SPECS[BenchConfig(n)].oracle_pool
    }


def _without_oracle(configs: Sequence[str]) -> tuple[str, ...]:
    return tuple(c for c in configs if not SPECS[BenchConfig(c)].oracle_pool)


def _write(report: dict[str, Any], out: Any) -> None:
    (out / "sweep.json").write_text(json.dumps(report, indent=1))
    (out / "sweep.md").write_text(sweep_markdown(report))


def run_agents_sweep(
    opts: Any, pools: Sequence[int], progress: ProgressFn | None = None
) -> dict[str, Any]:
    """``opts``: a ``runner.BenchOptions`` (its ``num_blocks`` is replaced per pool size; its
    ``max_model_len`` must fit the smallest). Writes ``sweep.json`` / ``sweep.md``."""
    from agentkv_bench.runner import machine_info, run_bench

    opts.out.mkdir(parents=True, exist_ok=True)
    per_pool: dict[int, dict[str, dict[str, Any]]] = {}
    reports: dict[int, str] = {}
    oracle: dict[str, Any] | None = None
    for i, n in enumerate(pools):
        o = dataclasses.replace(
            opts,
            num_blocks=n,
            out=opts.out / f"pool-{n}",
            configs=opts.configs if i == 0 else _without_oracle(opts.configs),
            overhead=opts.overhead if i == 0 else None,
        )
        rep = run_bench(o, _prefixed(progress, f"[{n} blocks] "))
        per_pool[n] = pool_summaries(rep, o.configs)
        reports[n] = str(o.out)
        if BenchConfig.ORACLE.value in rep["configs"]:
            oracle = dict(rep["configs"][BenchConfig.ORACLE.value]["summary"])
    report = build_sweep(
        kind="synthetic agent workload",
        command=opts.command,
        machine=machine_info(),
        configs=list(opts.configs),
        pools=per_pool,
        oracle=oracle,
        reports=reports,
        conditions=CONDITIONS,
    )
    _write(report, opts.out)
    return report


def run_trace_sweep(
    opts: Any, pools: Sequence[int], progress: ProgressFn | None = None
) -> dict[str, Any]:
    """``opts``: a ``trace_runner.TraceBenchOptions``. Writes ``sweep.json`` / ``sweep.md``."""
    from agentkv.simulate.bounds import trace_report_bound
    from agentkv_bench.runner import machine_info
    from agentkv_bench.trace_runner import run_trace_bench

    opts.out.mkdir(parents=True, exist_ok=True)
    per_pool: dict[int, dict[str, dict[str, Any]]] = {}
    reports: dict[int, str] = {}
    bounds: dict[int, dict[str, Any] | None] = {}
    oracle_cfg: dict[str, Any] | None = None
    for i, n in enumerate(pools):
        o = dataclasses.replace(
            opts,
            num_blocks=n,
            out=opts.out / f"pool-{n}",
            configs=tuple(opts.configs) if i == 0 else _without_oracle(opts.configs),
        )
        rep = run_trace_bench(o, _prefixed(progress, f"[{n} blocks] "))
        per_pool[n] = pool_summaries(rep, o.configs)
        reports[n] = str(o.out)
        if BenchConfig.ORACLE.value in rep["configs"]:
            oracle_cfg = rep["configs"][BenchConfig.ORACLE.value]
        bound = rep.get("capacity_equal_bound")
        if bound is None and oracle_cfg is not None:
            # This pool ran no oracle: the bound is fitted to the first pool's oracle run.
            bound = trace_report_bound(
                {"configs": {"oracle": oracle_cfg}, "trace": rep["trace"], "server": rep["server"]}
            )
        bounds[n] = (bound or {}).get("summary")
    report = build_sweep(
        kind="recorded trace " + str(opts.trace),
        command=opts.command,
        machine=machine_info(),
        configs=list(opts.configs),
        pools=per_pool,
        oracle=dict(oracle_cfg["summary"]) if oracle_cfg else None,
        bounds=bounds,
        reports=reports,
        conditions=CONDITIONS,
    )
    _write(report, opts.out)
    return report
