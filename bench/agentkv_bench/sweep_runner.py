"""Run a configuration x pool-size sweep: ``agentkv bench agents [--trace FILE] --configs ...
--num-blocks A,B,C``.

Primitives:
  run_agents_sweep(opts, pools, progress, repeats) -> the sweep report (synthetic workload)
  run_trace_sweep(opts, pools, progress, repeats)  -> the sweep report (a recorded trace)
  pool_summaries(report, configs)          {configuration: summary} of one single-pool report
  repeat_dir(out, pool, repeat, repeats)   where one repeat's single-pool report goes

Each pool size is one ordinary single-pool bench (``runner.run_bench`` /
``trace_runner.run_trace_bench``) with its full report in ``<out>/pool-<N>/``; every server runs
alone, one after another. With ``repeats`` N > 1 each pool size is N such benches, in
``<out>/pool-<N>/rep-1/`` ... ``rep-N/``, the configurations in the given order in the first,
reversed in the second and so on (``repeats.run_order``); the sweep reports the median of each
metric over them. The oracle (its pool computed from the workload, the same whatever the
swept size) runs once, with the first pool size's first repeat. The capacity-equal bound (a simulation fitted to
the oracle run, ``agentkv.simulate.bounds``) is computed for every pool size of a trace sweep; the
synthetic workload has no simulator form, so its sweep has none. The sweep's own report
(``sweep.json``, ``sweep.md`` in ``<out>``) holds every metric per configuration and pool size,
agentkv's regret against the best fixed policy and the targets (``sweep``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentkv_bench.matrix import SPECS, BenchConfig
from agentkv_bench.progress import ProgressFn
from agentkv_bench.repeats import repeat_label, run_order, validate_repeats
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


@dataclass
class _PoolRuns:
    """One pool size's repeats: each repeat's summaries (in --configs order, no oracle), the
    order the configurations ran in, and the first repeat's full report."""

    summaries: list[dict[str, dict[str, Any]]] = field(default_factory=list)
    orders: list[tuple[str, ...]] = field(default_factory=list)
    first: dict[str, Any] = field(default_factory=dict)


def repeat_dir(out: Path, pool: int, repeat: int, repeats: int) -> Path:
    """``<out>/pool-<N>`` without repeats (today's layout), ``<out>/pool-<N>/rep-<k>`` (k from 1)
    with them."""
    base = out / f"pool-{pool}"
    return base if repeats == 1 else base / f"rep-{repeat + 1}"


def _run_pool(
    opts: Any,
    index: int,
    pool: int,
    repeats: int,
    run_one: Callable[[Any, ProgressFn | None], dict[str, Any]],
    progress: ProgressFn | None,
    later: Mapping[str, Any],
) -> _PoolRuns:
    """Every repeat of one pool size, one single-pool bench each, the order alternating
    (``repeats.run_order``). The oracle (and whatever ``later`` resets, e.g. the overhead run)
    only in the sweep's first run: the first repeat of the first pool size."""
    runs = _PoolRuns()
    for k in range(repeats):
        first = index == 0 and k == 0
        order = run_order(tuple(opts.configs) if first else _without_oracle(opts.configs), k)
        o = dataclasses.replace(
            opts,
            num_blocks=pool,
            out=repeat_dir(opts.out, pool, k, repeats),
            configs=order,
            **({} if first else later),
        )
        rep = run_one(o, _prefixed(progress, repeat_label(pool, k, repeats)))
        runs.summaries.append(pool_summaries(rep, opts.configs))
        runs.orders.append(order)
        if k == 0:
            runs.first = rep
    return runs


def run_agents_sweep(
    opts: Any, pools: Sequence[int], progress: ProgressFn | None = None, repeats: int = 1
) -> dict[str, Any]:
    """``opts``: a ``runner.BenchOptions`` (its ``num_blocks`` is replaced per pool size; its
    ``max_model_len`` must fit the smallest). ``repeats``: runs of every configuration per pool
    size. Writes ``sweep.json`` / ``sweep.md``."""
    from agentkv_bench import runner

    validate_repeats(repeats)
    opts.out.mkdir(parents=True, exist_ok=True)
    per_pool: dict[int, list[dict[str, dict[str, Any]]]] = {}
    orders: dict[int, list[tuple[str, ...]]] = {}
    reports: dict[int, str] = {}
    oracle: dict[str, Any] | None = None
    for i, n in enumerate(pools):
        runs = _run_pool(opts, i, n, repeats, runner.run_bench, progress, {"overhead": None})
        per_pool[n], orders[n] = runs.summaries, runs.orders
        reports[n] = str(opts.out / f"pool-{n}")
        if BenchConfig.ORACLE.value in runs.first["configs"]:
            oracle = dict(runs.first["configs"][BenchConfig.ORACLE.value]["summary"])
    report = build_sweep(
        kind="synthetic agent workload",
        command=opts.command,
        machine=runner.machine_info(),
        configs=list(opts.configs),
        pools=per_pool,
        oracle=oracle,
        reports=reports,
        conditions=CONDITIONS,
        orders=orders,
    )
    _write(report, opts.out)
    return report


def run_trace_sweep(
    opts: Any, pools: Sequence[int], progress: ProgressFn | None = None, repeats: int = 1
) -> dict[str, Any]:
    """``opts``: a ``trace_runner.TraceBenchOptions``; ``repeats`` as ``run_agents_sweep``.
    Writes ``sweep.json`` / ``sweep.md``."""
    from agentkv.simulate import bounds as sim_bounds
    from agentkv_bench import trace_runner
    from agentkv_bench.runner import machine_info

    validate_repeats(repeats)
    opts.out.mkdir(parents=True, exist_ok=True)
    per_pool: dict[int, list[dict[str, dict[str, Any]]]] = {}
    orders: dict[int, list[tuple[str, ...]]] = {}
    reports: dict[int, str] = {}
    bounds: dict[int, dict[str, Any] | None] = {}
    oracle_cfg: dict[str, Any] | None = None
    for i, n in enumerate(pools):
        runs = _run_pool(opts, i, n, repeats, trace_runner.run_trace_bench, progress, {})
        per_pool[n], orders[n] = runs.summaries, runs.orders
        reports[n] = str(opts.out / f"pool-{n}")
        rep = runs.first
        if BenchConfig.ORACLE.value in rep["configs"]:
            oracle_cfg = rep["configs"][BenchConfig.ORACLE.value]
        bound = rep.get("capacity_equal_bound")
        if bound is None and oracle_cfg is not None:
            # This pool ran no oracle: the bound is fitted to the first pool's oracle run.
            bound = sim_bounds.trace_report_bound(
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
        orders=orders,
    )
    _write(report, opts.out)
    return report
