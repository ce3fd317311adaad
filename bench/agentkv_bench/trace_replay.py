"""Replay a recorded trace against one server: a closed loop per session, token-id prompts.

Primitives:
  MODES             the bench configurations (``matrix.BenchConfig``): vanilla, agentkv,
                    retain-always, offload-always (agentkv's driver, a fixed pause action), oracle
                    (vanilla vLLM with a pool that never evicts)
  RoundRecord       one request's measurements (TTFT, latency, tokens, hits, pause decision)
  SessionRecord     one session's job completion time and its rounds
  complete_ids(client, base_url, model, prompt, max_tokens, params) -> Streamed (streaming.py)
  replay_session(...)  one session: start at its arrival; per round send, read the whole reply,
                    pause (agentkv), wait ``wait_after_s``, resume (agentkv), next round
  replay(...)       every session concurrently -> [SessionRecord]

Every request is a streamed ``POST /v1/completions`` whose ``prompt`` is the round's token ids
(built by ``trace_prompts``), ``max_tokens`` the round's ``output_len``, ``ignore_eos`` (so
exactly that many tokens are decoded), temperature 0 and ``stream_options.include_usage``.
TTFT is the wall time from just before the request is sent to the first SSE chunk that carries
a choice (the first token exists: queueing + any KV load + prefill + one loopback hop).
Prompt and cached tokens come from the final usage chunk; agentkv's per-round device and tier
hits from ``GET /agentkv/v1/trajectories/{id}`` before the session's ``DELETE``.

With agentkv each session is a trajectory (``kv_transfer_params.agentkv.trajectory_id``); every
wait is announced with ``POST .../pause`` (tool ``trace-tool``, no expected wait: a recorded
trace says how long the wait was, a live agent would not know) and ended with ``.../resume``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from agentkv.traces import TraceSession, TraceWorkload
from agentkv_bench.drivers import PauseVia
from agentkv_bench.matrix import SPECS, BenchConfig
from agentkv_bench.records import RoundRecord
from agentkv_bench.streaming import Streamed, stream_measured
from agentkv_bench.trace_prompts import RoundPrompt

MODES: tuple[str, ...] = tuple(c.value for c in BenchConfig)
TOOL = "trace-tool"


TIMEOUT = httpx.Timeout(1800.0, connect=30.0)


@dataclass
class SessionRecord:
    session_id: str
    trajectory_id: str
    started_at_s: float
    jct_s: float  # from its first request to the end of its last round, waits included
    rounds: list[RoundRecord] = field(default_factory=list)


async def complete_ids(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    prompt: Sequence[int],
    max_tokens: int,
    params: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    hint: dict[str, Any] | None = None,
) -> Streamed:
    """One streamed completion of token ids; raises RuntimeError naming the server's answer."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if params is not None:
        body["kv_transfer_params"] = {"agentkv": params}
    if hint:
        body.update(hint)
    return await stream_measured(client, base_url + "/v1/completions", body, headers)


async def _control(
    client: httpx.AsyncClient, method: str, url: str, body: dict[str, Any] | None = None
) -> dict[str, Any]:
    r = await client.request(method, url, json=body)
    if r.status_code >= 400:
        raise RuntimeError(f"{method} {url} failed: {r.status_code} {r.text[:300]}")
    out = r.json()
    return out if isinstance(out, dict) else {}


Progress = Callable[[RoundRecord], None]
# A fleet: the base URL of the replica that holds a trajectory (control calls go there).
Locate = Callable[[str], Awaitable[str]]


async def replay_session(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    mode: str,
    session: TraceSession,
    prompts: Sequence[RoundPrompt],
    trajectory_id: str,
    t_run: float,
    on_round: Progress | None = None,
    paused: dict[str, int] | None = None,
    locate: Locate | None = None,
    pause_via: PauseVia = PauseVia.ROUTES,
) -> SessionRecord:
    """Run one session's rounds in order, each after the previous reply and its wait.

    ``paused`` maps the trajectories waiting right now to their context tokens (the occupancy
    sampler reads it). ``locate`` (a fleet behind a router): every call names the session
    (``x-session-id`` on completions, ``agent_hint.session_id`` and ``model`` in completion and
    pause/resume bodies, which vllm-router routes by); pause and resume go through the router,
    the final GET and DELETE (no body to route by) to the replica ``locate`` names.
    ``pause_via`` REQUEST: every round but the last asks for its pause in its own request
    (``pause_after``) and the next round's request resumes it: no control call per wait.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if len(prompts) != len(session.rounds):
        raise ValueError("one prompt per round")
    # Every configuration with the connector is driven alike (trajectory, pause, resume): they
    # differ only in what the server decides at the pause.
    agentkv = SPECS[BenchConfig(mode)].trajectory
    path = f"/agentkv/v1/trajectories/{trajectory_id}"
    params: dict[str, Any] | None = {"trajectory_id": trajectory_id} if agentkv else None
    headers = {"x-session-id": trajectory_id} if locate is not None else None
    hint: dict[str, Any] = (
        {"model": model, "agent_hint": {"session_id": trajectory_id}} if locate else {}
    )
    routes = base_url + path
    await asyncio.sleep(max(0.0, session.arrival_s - (time.monotonic() - t_run)))
    started = time.monotonic()
    rec = SessionRecord(session.session_id, trajectory_id, started - t_run, 0.0)
    sent_any = False
    try:
        for i, (rnd, rp) in enumerate(zip(session.rounds, prompts, strict=True)):
            decision: dict[str, Any] = {}
            control_s: float | None = None
            wait = session.rounds[i - 1].wait_after_s if i else 0.0
            calls = agentkv and pause_via is PauseVia.ROUTES
            if i:
                waiting = (trajectory_id, len(prompts[i - 1].context))
                decision, control_s = await _wait_between(
                    client, routes if calls else None, hint, wait, waiting, paused
                )
            round_params = params
            if params is not None and not calls and i + 1 < len(session.rounds):
                round_params = {**params, "pause_after": {"tool": TOOL}}
            sent = time.monotonic() - t_run
            sent_any = True
            s = await complete_ids(
                client, base_url, model, rp.prompt, rnd.output_len, round_params, headers, hint
            )
            r = RoundRecord(
                session_id=session.session_id,
                trajectory_id=trajectory_id,
                round=i,
                kind="resume" if i else "first",
                wait_before_s=wait,
                sent_at_s=sent,
                **asdict(s),  # the stream's TTFT, latency and token counts
                planned_prefix=rp.from_history,
                reusable_tokens=min(rp.from_history, len(prompts[i - 1].prompt) if i else 0),
                decision=str(decision["action"]) if "action" in decision else None,
                writeback_deferred=_opt(decision, "writeback_deferred", bool),
                eviction_in_s=_opt(decision, "eviction_in_s", float),
                wait_p90_s=_opt(decision, "wait_p90_s", float),
                control_s=control_s,
            )
            rec.rounds.append(r)
            if on_round is not None:
                on_round(r)
        rec.jct_s = time.monotonic() - started
    finally:
        if agentkv and sent_any:
            holder = await locate(trajectory_id) if locate is not None else base_url
            await _end_session(client, holder + path, rec.rounds)
    return rec


async def _end_session(client: httpx.AsyncClient, url: str, rounds: list[RoundRecord]) -> None:
    """A trajectory's last calls: its per-turn engine stats (GET) onto its rounds, then DELETE."""
    state = await _control(client, "GET", url)
    _attach_engine_stats(rounds, state.get("turns") or [])
    await _control(client, "DELETE", url)


async def _wait_between(
    client: httpx.AsyncClient,
    routes: str | None,
    hint: dict[str, Any],
    wait: float,
    waiting: tuple[str, int],
    paused: dict[str, int] | None,
) -> tuple[dict[str, Any], float | None]:
    """The wait after a round: ``POST .../pause`` when ``routes`` (agentkv), sleep ``wait``
    seconds listed in ``paused`` (trajectory id -> context tokens), ``POST .../resume``.
    Returns the pause decision as the server answered it ({} without agentkv or a decision) and
    the pause and resume calls' wall time together (None without agentkv): the agent waits for
    both, so the server's answer time is on the job's critical path."""
    decision: dict[str, Any] = {}
    control_s = 0.0
    if routes is not None:
        t0 = time.monotonic()
        reply = await _control(client, "POST", routes + "/pause", {"tool": TOOL, **hint})
        control_s += time.monotonic() - t0
        d = reply.get("decision")
        decision = d if isinstance(d, dict) and "action" in d else {}
    if paused is not None:
        paused[waiting[0]] = waiting[1]
    await asyncio.sleep(wait)
    if paused is not None:
        paused.pop(waiting[0], None)
    if routes is not None:
        t0 = time.monotonic()
        await _control(client, "POST", routes + "/resume", hint)
        control_s += time.monotonic() - t0
    return decision, (control_s if routes is not None else None)


def _opt(decision: dict[str, Any], key: str, kind: type) -> Any:
    """``decision[key]`` as ``kind``, or None when absent or null (a non-finite number)."""
    v = decision.get(key)
    return None if v is None else kind(v)


def _attach_engine_stats(rounds: list[RoundRecord], stats: list[Any]) -> None:
    """Match the server's per-turn stats to rounds: turn k is round k-1 on branch main."""
    by_turn = {
        int(s["turn"]): s
        for s in stats
        if isinstance(s, dict) and s.get("branch", "main") == "main" and "turn" in s
    }
    for r in rounds:
        s = by_turn.get(r.round + 1)
        if s is None or s.get("prompt_tokens") != r.prompt_tokens:
            continue
        r.device_hit_tokens = int(s.get("device_hit_tokens") or 0)
        r.tier_hit_tokens = int(s.get("tier_hit_tokens") or 0)
        r.tier = s.get("tier")
        r.prefetch = s.get("prefetch")


def trajectory_id(run_tag: str, index: int) -> str:
    """Ids in the agentkv grammar whatever the trace's session ids look like."""
    return f"trace-{run_tag}-{index}"


async def replay(
    workload: TraceWorkload,
    prompts: Sequence[Sequence[RoundPrompt]],
    mode: str,
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    run_tag: str,
    on_round: Progress | None = None,
    paused: dict[str, int] | None = None,
    t_run: float | None = None,
    locate: Locate | None = None,
    pause_via: PauseVia = PauseVia.ROUTES,
) -> list[SessionRecord]:
    """Every session of ``workload`` at once, each from its arrival time."""
    t0 = time.monotonic() if t_run is None else t_run
    return list(
        await asyncio.gather(
            *(
                replay_session(
                    client,
                    base_url,
                    model,
                    mode,
                    s,
                    prompts[i],
                    trajectory_id(run_tag, i),
                    t0,
                    on_round,
                    paused,
                    locate,
                    pause_via,
                )
                for i, s in enumerate(workload.sessions)
            )
        )
    )
