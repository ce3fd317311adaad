"""Where a small layer-by-layer host reload's time goes (issue 27): the plugin's worker-side load
code, driven without a vLLM server, timed end to end and per phase.

    python -m agentkv_bench.reload_phases [--blocks 8] [--reps 300] [--forward] [--cold] [--json]

Geometry: the ``tiny`` preset (agentkv.modelgen) in vLLM's CPU layout: 4 layers of
``[num_blocks=24, kv_heads=2, block_size=128, 2*head_dim=128]`` bf16, so one block is 4 runs of
64 KiB (256 KiB) and 8 blocks are 2 MiB, the size of the trace bench's resume reloads
(bench/results/sweep-large16: 73 jobs of ~1.7 MiB). Each rep: ``start_step`` with one layerwise
``LoadJob`` of the blocks (shuffled engine ids), ``wait_for_layer`` per layer in forward order (as
vLLM's attention layers do), ``finish_step``, ``take_report``: exactly the plugin's calls.

Phases (perf_counter_ns stamps from wrappers around the worker's own functions; the wrappers add
~1 us each, so the ``end to end`` row is also measured with none installed):
  submit        ``start_step`` on the engine thread up to the copy (keys, address arrays,
                copier setup, the handoff call), less the pins
  pins          pinning the host copies (``acquire_host``: the store's lock, a pin, a read-only
                view and an address per block)
  handoff       the copy handed to the copier thread: from ``submit`` to the copy's first line
                (0 where the copy runs on the engine thread)
  layer copy    per layer, the kernel call (native_copy.copy_runs): the bytes moving
  layer python  the rest of the copy function around the kernel calls (argument checks,
                address arrays, dispatch, the disk check, its loop over layers)
  event set     per layer, ``LayerEvent.set``
  release       unpinning the host copies (``release_host``)
  wait          the engine thread blocked in ``wait_for_layer`` / ``finish_step`` beyond the
                copy thread's own work (its wake-up after the copy is done)
  report        ``finish_step``'s bookkeeping and ``take_report``
``metric`` is what the plugin reports as the job's reload seconds (agentkv_reload_seconds, the
trace bench's "reload time"); ``memcpy`` a numpy copy of the same bytes, best of 5 per rep.
``--forward`` runs a stand-in forward pass on the engine thread (per layer, before its wait, the
tiny model's MLP matmuls for 16 tokens on torch's threads), as in a real prefill step: the copier
thread then shares the cores and the GIL with it. ``--cold``: 512 MiB of blocks in host, each
rep reloading the next 8 (their bytes come from memory, not cache, as a resume's do, blocks
stored long before), against a memcpy from sources spread over as much (median of 50).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from agentkv.manager.jobs import BlockTransfer, LoadJob, StepPlan, StoreJob
from agentkv.modelgen import PRESETS
from agentkv.tier import Tier
from agentkv.tiers import TieredStore, native_copy
from agentkv_vllm import device_copy
from agentkv_vllm.metadata import AgentKVStepMetadata
from agentkv_vllm.settings import ConnectorSettings
from agentkv_vllm.worker_side import WorkerSide

NUM_BLOCKS, BLOCK_TOKENS = 24, 128
# --cold: the host blocks reloaded in turn span this much memory, so none is still in cache
COLD_POOL_BYTES = 512 << 20
PHASES = (
    "submit",
    "pins",
    "handoff",
    "layer copy",
    "layer python",
    "event set",
    "release",
    "wait",
    "report",
)


@dataclass
class Stamps:
    """One rep's phase durations in ns (summed where a phase repeats per layer)."""

    ns: dict[str, int] = field(default_factory=dict)

    def add(self, phase: str, ns: int) -> None:
        self.ns[phase] = self.ns.get(phase, 0) + ns


def tiny_caches(num_blocks: int = NUM_BLOCKS) -> dict[str, torch.Tensor]:
    """The tiny preset's KV cache in vLLM's CPU layout, random bytes."""
    p = PRESETS["tiny"]
    gen = torch.Generator().manual_seed(0)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randint(
            -(2**15), 2**15, (num_blocks, p.num_kv_heads, BLOCK_TOKENS, 2 * p.head_dim),
            dtype=torch.int16, generator=gen,
        ).view(torch.bfloat16)
        for i in range(p.num_layers)
    }  # fmt: skip


def _worker(caches: dict[str, torch.Tensor], num_blocks: int) -> WorkerSide:
    w = WorkerSide(
        settings=ConnectorSettings(
            host_capacity_gib=COLD_POOL_BYTES / 2**30 + 0.05, run_dir="/tmp"
        ),
        model_id="tiny",
        tp_rank=0,
        tp_size=1,
        num_blocks=num_blocks,
    )
    w.register_kv_caches(caches)
    return w


def _store(w: WorkerSide, blocks: int) -> list[bytes]:
    """``blocks`` keys stored to host from the cache's blocks in turn."""
    keys = [f"k{i}".encode() for i in range(blocks)]
    w.start_step(
        AgentKVStepMetadata(
            StepPlan(stores=[StoreJob(1, Tier.HOST, [BlockTransfer(k, i % w.num_blocks) for i, k in enumerate(keys)])])
        )
    )  # fmt: skip
    for p in w._jobs:
        p.handle.result()
    w.poll()
    w.take_report()
    return keys


class _Instruments:
    """Timing wrappers around the worker's own functions, installed for the phase table."""

    def __init__(self) -> None:
        self.stamps = Stamps()
        self._undo: list[Callable[[], None]] = []

    def _wrap(self, owner: Any, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                self.stamps.add(phase, time.perf_counter_ns() - t0)

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, original))

    def install(self) -> None:
        self._wrap(native_copy, "copy_runs", "layer copy")
        self._wrap(device_copy.LayerEvent, "set", "event set")
        self._wrap(TieredStore, "release_host", "release")
        self._wrap(TieredStore, "acquire_host", "pins")

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()

    def rep(self) -> Stamps:
        """Start a fresh rep; returns its Stamps."""
        self.stamps = Stamps()
        return self.stamps


class _TimedPool(ThreadPoolExecutor):
    """The copier pool, stamping when a copy is handed over and when its first line runs."""

    def __init__(self, marks: dict[str, int]) -> None:
        super().__init__(1, thread_name_prefix="agentkv-layers")
        self.marks = marks

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        marks = self.marks
        marks["handed"] = time.perf_counter_ns()  # the sync path never gets here

        def run() -> Any:
            marks["began"] = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                marks["ended"] = time.perf_counter_ns()

        return super().submit(run)


def _stamp_copy(w: WorkerSide, marks: dict[str, int]) -> None:
    """Stamp the step copy's first and last line wherever it runs (the copier thread, or the
    engine thread for a small CPU step); code without ``_copy_layers`` only copies on the
    thread, which ``_TimedPool`` stamps."""
    copy = getattr(w, "_copy_layers", None)
    if copy is None:
        return

    def stamped(*args: Any) -> Any:
        marks["began"] = time.perf_counter_ns()
        try:
            return copy(*args)
        finally:
            marks["ended"] = time.perf_counter_ns()

    setattr(w, "_copy_layers", stamped)  # noqa: B010 (an instance attribute over the method)


def _forward_stand_in(tokens: int = 16) -> Callable[[], None]:
    """One layer of a stand-in forward pass: the tiny model's MLP matmuls for ``tokens`` (fp32,
    about a millisecond: torch's own threads busy on the cores while the copy runs)."""
    p = PRESETS["tiny"]
    x = torch.randn(tokens, p.hidden_size)
    up = torch.randn(p.hidden_size, p.intermediate_size)
    down = torch.randn(p.intermediate_size, p.hidden_size)

    def layer() -> None:
        torch.matmul(torch.matmul(x, up), down)

    return layer


def _memcpy_ns(nbytes: int, cold: bool) -> int:
    """A numpy copy of ``nbytes``: best of 5 of one buffer (the trace report's baseline: the
    source hot in cache), or ``cold``: the median of 50 copies from sources spread over
    COLD_POOL_BYTES (the source in memory, as a block stored long ago is)."""
    dst = np.zeros(nbytes, np.uint8)
    if not cold:
        src = np.ones(nbytes, np.uint8)
        best = 1 << 62
        for _ in range(5):
            t0 = time.perf_counter_ns()
            np.copyto(dst, src)
            best = min(best, time.perf_counter_ns() - t0)
        return best
    pool = np.ones(COLD_POOL_BYTES, np.uint8)
    spans: list[int] = []
    for i in range(50):
        start = (i * 7 * nbytes) % (COLD_POOL_BYTES - nbytes)
        t0 = time.perf_counter_ns()
        np.copyto(dst, pool[start : start + nbytes])
        spans.append(time.perf_counter_ns() - t0)
    return int(statistics.median(spans))


def one_rep(
    w: WorkerSide, keys: list[bytes], marks: dict[str, int], forward: Callable[[], None] | None
) -> tuple[int, float]:
    """One layerwise reload step as the engine drives it: (ns end to end, reported seconds)."""
    assert w.views is not None
    targets = random.sample(range(w.num_blocks), len(keys))
    job = LoadJob(7, "r", [BlockTransfer(k, b) for k, b in zip(keys, targets, strict=True)], True)
    meta = AgentKVStepMetadata(StepPlan(loads=[job]))
    t0 = time.perf_counter_ns()
    marks["entered"] = t0
    w.start_step(meta)
    marks["submitted"] = time.perf_counter_ns()
    for name in w.views.layer_names:
        if forward is not None:
            forward()
        w.wait_for_layer(name)
    w.finish_step()
    marks["finished"] = time.perf_counter_ns()
    report = w.take_report()
    t1 = time.perf_counter_ns()
    assert report is not None and not report.report.jobs_failed, "the reload failed"
    [(_, seconds)] = report.report.transfers.values()
    return t1 - t0, seconds


def _phases(stamps: Stamps, marks: dict[str, int], end_ns: int) -> dict[str, int]:
    """A rep's timeline cut into PHASES (ns); they add up to its end to end time when the
    engine thread does nothing else (no ``--forward``)."""
    ns = stamps.ns
    handed = marks.get("handed", marks["began"])
    began, ended = marks["began"], marks["ended"]
    accounted = ns.get("layer copy", 0) + ns.get("event set", 0) + ns.get("release", 0)
    return {
        "submit": handed - marks["entered"] - ns.get("pins", 0),
        "pins": ns.get("pins", 0),
        "handoff": began - handed,
        "layer copy": ns.get("layer copy", 0),
        "layer python": ended - began - accounted,  # the copy's own lines, around the kernel
        "event set": ns.get("event set", 0),
        "release": ns.get("release", 0),
        "wait": max(0, marks["finished"] - max(ended, marks["submitted"])),
        "report": end_ns - marks["finished"],
    }


def measure(blocks: int, reps: int, forward: bool, cold: bool = False) -> dict[str, Any]:
    """End to end and per phase medians (us) of ``reps`` layerwise reloads of ``blocks``."""
    native_copy.warm_up(background=False)
    w = _worker(tiny_caches(), NUM_BLOCKS)
    assert w.views is not None
    pool = _store(w, COLD_POOL_BYTES // w.views.block_bytes if cold else blocks)
    groups = [pool[i : i + blocks] for i in range(0, len(pool) - blocks + 1, blocks)]
    turn = iter(range(1 << 62))  # cold: each rep reloads the next group, not recently copied
    marks: dict[str, int] = {}
    w._copier = _TimedPool(marks)
    _stamp_copy(w, marks)
    step = _forward_stand_in() if forward else None
    plain = [one_rep(w, groups[next(turn) % len(groups)], marks, step) for _ in range(reps)]
    inst = _Instruments()
    inst.install()
    rows: list[dict[str, int]] = []
    try:
        for _ in range(reps):
            stamps = inst.rep()
            marks.clear()
            ns, _ = one_rep(w, groups[next(turn) % len(groups)], marks, step)
            rows.append(_phases(stamps, marks, marks["entered"] + ns))
    finally:
        inst.remove()
        w.shutdown()
    nbytes = blocks * w.views.block_bytes
    end_to_end = statistics.median(ns for ns, _ in plain) / 1e3
    phases = {p: statistics.median(r[p] for r in rows) / 1e3 for p in PHASES}
    return {
        "blocks": blocks,
        "bytes": nbytes,
        "reps": reps,
        "forward": forward,
        "end_to_end_us": end_to_end,
        "metric_us": statistics.median(s for _, s in plain) * 1e6,
        "memcpy_us": _memcpy_ns(nbytes, cold) / 1e3,
        "cold": cold,
        "phases_us": phases,
    }


def _label(phase: str, result: dict[str, Any]) -> str:
    return "wait (incl. the forward stand-in)" if phase == "wait" and result["forward"] else phase


def table(result: dict[str, Any]) -> str:
    """The phase table (markdown): phase, median us, share of the sum of the phase medians."""
    phases = result["phases_us"]
    total = sum(phases.values()) or 1.0
    lines = [
        f"{result['blocks']} blocks, {result['bytes'] / 2**20:.2f} MiB, {result['reps']} reps, "
        f"forward stand-in {'on' if result['forward'] else 'off'}",
        "",
        "| phase | us (median) | share |",
        "|---|---:|---:|",
        *(f"| {_label(p, result)} | {us:.1f} | {us / total:.0%} |" for p, us in phases.items()),
        f"| sum of phases (instrumented) | {total:.1f} | |",
        f"| end to end (no instruments) | {result['end_to_end_us']:.1f} | |",
        f"| metric: reported reload seconds | {result['metric_us']:.1f} | |",
        f"| memcpy of the same bytes (numpy, {'cold source' if result.get('cold') else 'best of 5'})"
        f" | {result['memcpy_us']:.1f} | |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--forward", action="store_true")
    parser.add_argument("--cold", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args.blocks, args.reps, args.forward, args.cold)
    print(json.dumps(result, indent=1) if args.json else table(result))


if __name__ == "__main__":
    main()
