"""Step probe: times a fixed set of vLLM engine-core and worker methods in every process of a
server, for ``agentkv bench overhead --step-times``.

Loaded by Python at start-up as ``sitecustomize`` when the bench puts this folder first on the
server's PYTHONPATH, and active only when ``AGENTKV_STEP_PROBE_DIR`` is set. It wraps each target
method once its module is imported (a meta-path hook; nothing of vLLM is imported early) and
appends (target index, start, duration) triples of doubles, CLOCK_MONOTONIC seconds, to
``probe-<pid>.bin`` in that folder: in batches of FLUSH records, one ``write`` each, so the probe
costs a few hundred nanoseconds per call and no file I/O inside most steps. The bench keeps the
records inside each phase's timed window (the clock is system-wide).

Why end-to-end latency is not enough: a server start moves the model's forward by +-5% on this
machine (memory placement, neighbours), more than the cost the target asks to resolve (1%).
The parts of a step outside the forward (scheduling, the connector hooks, the executor's
round trips) hold still between starts, so their difference is measured to microseconds.
Stdlib only: this runs inside vLLM's processes.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import os
import sys
import time
from array import array
from typing import Any

# (module, class, method): index in this tuple is the record's first field.
TARGETS: tuple[tuple[str, str, str], ...] = (
    ("vllm.v1.engine.core", "EngineCore", "step"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"),
    ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor", "execute_model"),
    ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor", "sample_tokens"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens"),
)
KEYS: tuple[str, ...] = tuple(f"{c}.{m}" for _, c, m in TARGETS)
ENV = "AGENTKV_STEP_PROBE_DIR"
# More methods to time, comma-separated ``module:Class.method`` (e.g. agentkv's control handler,
# ``agentkv_vllm.control_ops:ControlOps.handle``); their records follow TARGETS' indices, in
# this order, and their names go to EXTRA_FILE in the probe folder for the reader.
EXTRA_ENV = "AGENTKV_STEP_PROBE_EXTRA"
EXTRA_FILE = "extra-targets.txt"
# Set: every garbage collection is recorded too, as ``gc.gen0`` .. ``gc.gen2`` (after the
# extra targets).
GC_ENV = "AGENTKV_STEP_PROBE_GC"
GC_KEYS = ["gc.gen0", "gc.gen1", "gc.gen2"]


def parse_extra(text: str) -> tuple[tuple[str, str, str], ...]:
    """``module:Class.method,...`` -> (module, class, method) triples (ValueError on a bad one)."""
    out: list[tuple[str, str, str]] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        mod, _, rest = item.partition(":")
        cls, _, meth = rest.partition(".")
        if not (mod and cls and meth):
            raise ValueError(f"{EXTRA_ENV}: {item!r} is not module:Class.method")
        out.append((mod, cls, meth))
    return tuple(out)


FLUSH = 3 * 128  # doubles: 128 records, ~3 KiB per write


class _Sink:
    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.buf = array("d")
        self.fd: int | None = None
        # A forked child starts empty with a file of its own (its parent's records are the
        # parent's to write).
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self.buf = array("d")
        self.fd = None

    def add(self, index: int, start: float, seconds: float) -> None:
        self.buf.extend((float(index), start, seconds))
        if len(self.buf) >= FLUSH:
            self.flush()

    def flush(self) -> None:
        if not self.buf:
            return
        if self.fd is None:
            path = os.path.join(self.folder, f"probe-{os.getpid()}.bin")
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(self.fd, self.buf.tobytes())
        self.buf = array("d")


def _wrap(sink: _Sink, index: int, fn: Any) -> Any:
    clock = time.monotonic

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.add(index, start, clock() - start)

    timed.__wrapped__ = fn  # type: ignore[attr-defined]
    timed.__name__ = getattr(fn, "__name__", "timed")
    return timed


class _Hook(importlib.abc.MetaPathFinder):
    def __init__(self, sink: _Sink, targets: tuple[tuple[str, str, str], ...] = TARGETS) -> None:
        self.sink = sink
        self.targets = targets
        self.modules = {mod for mod, _, _ in targets}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.modules:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        load = spec.loader.exec_module  # type: ignore[union-attr]

        def exec_module(module: Any) -> None:
            load(module)
            for i, (mod, cls_name, meth) in enumerate(self.targets):
                cls = getattr(module, cls_name, None) if mod == fullname else None
                if cls is not None and meth in vars(cls):
                    setattr(cls, meth, _wrap(self.sink, i, vars(cls)[meth]))

        spec.loader.exec_module = exec_module  # type: ignore[method-assign,union-attr]
        return spec


def _watch_gc(sink: _Sink, first: int) -> None:
    """Each garbage collection as a record ``gc.gen<N>`` (index ``first + N``): a collection
    stops the process's every thread, so a full one in a process holding vLLM's object graph
    is a step's worth of stall."""
    import gc

    started: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[:] = [time.monotonic()]
        elif started:
            t0 = started.pop()
            sink.add(first + int(info.get("generation", 0)), t0, time.monotonic() - t0)

    gc.callbacks.append(on_gc)


def install(folder: str, extra: str = "", collections: bool = False) -> None:
    targets = TARGETS + parse_extra(extra)
    names = [f"{c}.{m}" for _, c, m in targets[len(TARGETS) :]]
    if collections:
        names += GC_KEYS
    if names:
        # Every process of the server writes the same names: a whole-file replace is enough.
        tmp = os.path.join(folder, f".{EXTRA_FILE}.{os.getpid()}")
        with open(tmp, "w") as fh:
            fh.writelines(f"{n}\n" for n in names)
        os.replace(tmp, os.path.join(folder, EXTRA_FILE))
    sink = _Sink(folder)
    atexit.register(sink.flush)
    sys.meta_path.insert(0, _Hook(sink, targets))
    if collections:
        _watch_gc(sink, len(targets))


if os.environ.get(ENV) and __name__ == "sitecustomize":
    install(os.environ[ENV], os.environ.get(EXTRA_ENV, ""), bool(os.environ.get(GC_ENV)))
