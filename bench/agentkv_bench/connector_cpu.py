"""The connector's own CPU time, read from ``GET /agentkv/v1/status`` before and after a phase.

The plugin's scheduler side clocks (thread CPU time, on the engine thread) what its hooks spend:
``connector_cpu.step`` = the per-step hooks (``build_connector_meta`` every engine step, and
``update_connector_output`` when a worker reported something), ``connector_cpu.request`` = the
per-request hooks of requests that carry agentkv params (plain requests return from every hook
before the clock starts). Both are cumulative ``{"calls": n, "cpu_s": x}``; a phase's figures are
the difference of two readings. That makes the overhead a measured figure instead of a difference
of two noisy throughputs.

Primitives (pure, unit-tested with recorded status bodies):
  reading(status)                      -> {"step": {"calls", "cpu_s"}, "request": {...}} or None
  delta(before, after)                 -> the same shape, after - before (None if unusable)
  add(a, b)                            -> the sum of two deltas (phases made of several runs)
  figures(d, wall_s, requests, steps)  -> per-call / per-request microseconds and CPU shares
  engine_steps(metrics_text)           -> vLLM's count of engine steps (``/metrics``) or None
Network:
  read_probe(base_url, headers)        -> {"connector_cpu": reading, "engine_steps": n} (sync)
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from typing import Any

import httpx

KINDS = ("step", "request")
# vLLM observes one sample per engine step with scheduled tokens in this histogram.
STEPS_RE = re.compile(r"^vllm:iteration_tokens_total_count(?:\{[^}]*\})?\s+([0-9.eE+-]+)$")

Reading = dict[str, dict[str, float]]


def reading(status: Mapping[str, Any] | None) -> Reading | None:
    """The ``connector_cpu`` part of a status body, both kinds present (0 when never called)."""
    if not status:
        return None
    raw = status.get("connector_cpu")
    if not isinstance(raw, Mapping):
        return None
    out: Reading = {}
    for kind in KINDS:
        part = raw.get(kind) or {}
        calls, cpu = part.get("calls", 0), part.get("cpu_s", 0.0)
        if not isinstance(calls, (int, float)) or not isinstance(cpu, (int, float)):
            return None
        out[kind] = {"calls": int(calls), "cpu_s": float(cpu)}
    return out


def delta(before: Reading | None, after: Reading | None) -> Reading | None:
    """``after - before`` per kind; None when either is missing or a counter went backwards
    (a restarted engine: the two readings are not of the same process)."""
    if before is None or after is None:
        return None
    out: Reading = {}
    for kind in KINDS:
        calls = after[kind]["calls"] - before[kind]["calls"]
        cpu = after[kind]["cpu_s"] - before[kind]["cpu_s"]
        if calls < 0 or cpu < -1e-9:
            return None
        out[kind] = {"calls": int(calls), "cpu_s": max(0.0, cpu)}
    return out


def add(a: Reading | None, b: Reading | None) -> Reading | None:
    if a is None:
        return b
    if b is None:
        return a
    return {
        kind: {
            "calls": int(a[kind]["calls"] + b[kind]["calls"]),
            "cpu_s": a[kind]["cpu_s"] + b[kind]["cpu_s"],
        }
        for kind in KINDS
    }


def _per(x: float, n: float | None, scale: float = 1e6) -> float | None:
    return x * scale / n if n else None


def figures(
    d: Reading | None,
    wall_s: float | None = None,
    requests: int | None = None,
    engine_steps: float | None = None,
) -> dict[str, Any]:
    """A phase's connector CPU in readable units.

    ``step_us_per_call``: step CPU / step hook calls, in µs (the per-step cost; a step with a
    worker report counts two calls). ``step_us_per_engine_step``: step CPU / vLLM's engine steps
    when known. ``request_us_per_request``: request CPU / the agentkv requests the phase sent.
    ``step_share_pct`` / ``share_pct``: step CPU (and step + request CPU) over the phase's wall
    time, in percent: the engine thread's time spent in the connector's scheduler side.
    """
    if d is None:
        return {"status": "unavailable"}
    step, req = d["step"], d["request"]
    total = step["cpu_s"] + req["cpu_s"]
    out: dict[str, Any] = {
        "status": "ok",
        "step_calls": step["calls"],
        "step_cpu_s": round(step["cpu_s"], 6),
        "step_us_per_call": _per(step["cpu_s"], step["calls"]),
        "engine_steps": int(engine_steps) if engine_steps is not None else None,
        "step_us_per_engine_step": _per(step["cpu_s"], engine_steps),
        "request_calls": req["calls"],
        "request_cpu_s": round(req["cpu_s"], 6),
        "request_us_per_call": _per(req["cpu_s"], req["calls"]),
        "requests": requests,
        "request_us_per_request": _per(req["cpu_s"], requests),
        "wall_s": wall_s,
        "step_share_pct": _per(step["cpu_s"], wall_s, 100.0) if wall_s else None,
        "share_pct": _per(total, wall_s, 100.0) if wall_s else None,
    }
    return out


def engine_steps(metrics_text: str) -> float | None:
    """Sum of ``vllm:iteration_tokens_total_count`` over its label sets; None if absent."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        m = STEPS_RE.match(line.strip())
        if m:
            total += float(m.group(1))
            seen = True
    return total if seen else None


def read_probe(base_url: str, headers: Mapping[str, str] | None = None) -> dict[str, Any]:
    """One reading: the connector's CPU clocks and vLLM's engine step count (either may be
    None: a vanilla server has no status route)."""
    out: dict[str, Any] = {"connector_cpu": None, "engine_steps": None}
    with httpx.Client(timeout=30.0, headers=dict(headers or {})) as c:
        try:
            r = c.get(base_url + "/agentkv/v1/status")
            if r.status_code == 200:
                out["connector_cpu"] = reading(r.json())
        except (httpx.HTTPError, ValueError):
            pass
        with contextlib.suppress(httpx.HTTPError):
            out["engine_steps"] = engine_steps(c.get(base_url + "/metrics").text)
    return out


def probe_delta(
    before: Mapping[str, Any] | None, after: Mapping[str, Any] | None
) -> tuple[Reading | None, float | None]:
    """(connector CPU delta, engine steps delta) between two ``read_probe`` results."""
    if not before or not after:
        return None, None
    d = delta(before.get("connector_cpu"), after.get("connector_cpu"))
    s0, s1 = before.get("engine_steps"), after.get("engine_steps")
    steps = s1 - s0 if isinstance(s0, (int, float)) and isinstance(s1, (int, float)) else None
    return d, (steps if steps is None or steps >= 0 else None)
