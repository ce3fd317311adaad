"""Run a Workload against one server: the same plan, the same requests, two clients.

Primitives:
  TurnRecord        one request's measurements (records.py: the record type every run shares)
  TrajectoryRecord  one trajectory's job completion time and its turns
  Session           what a driver must do: observe, complete (streamed), pause/resume, fork, close
  VanillaSession    plain OpenAI-compatible requests over httpx (no agentkv parameters)
  AgentKVSession    harness_sdk.Trajectory (kv_transfer_params, pause/resume routes; with
                    PauseVia.REQUEST a turn followed by a tool wait names it: then_tool)
  PauseVia          how a trajectory driver pauses for a tool wait (routes | request)
  run_workload()    every trajectory concurrently, each after its start offset; -> records

How TTFT is measured (identically in both): the turn is a streamed chat completion with
``stream_options.include_usage``; TTFT is the wall time from just before the request is sent
to the arrival of the first SSE chunk that carries a choice. vLLM sends that chunk when the
first output token exists, so TTFT = queueing + prefill (including any recompute or tier
reload) + one decode step + one loopback hop. Usage (prompt and cached tokens) comes from the
final chunk. Both bodies carry the same messages, ``max_tokens``, ``temperature`` 0 and
``ignore_eos`` (so every turn decodes exactly ``max_tokens`` tokens).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import httpx

from agentkv_bench.records import TurnRecord
from agentkv_bench.streaming import Streamed, stream_measured
from agentkv_bench.workload import TrajectoryPlan, TurnPlan, Workload
from harness_sdk import Trajectory
from harness_sdk.trajectory import ToolWait
from harness_sdk.zones import Context

TIMEOUT = httpx.Timeout(1800.0, connect=30.0)


class PauseVia(StrEnum):
    """How a trajectory driver pauses a session for a tool wait."""

    ROUTES = "routes"  # POST .../pause after the reply, POST .../resume after the wait
    REQUEST = "request"  # the turn's request carries pause_after; the next request resumes


@dataclass
class TrajectoryRecord:
    trajectory_id: str
    started_at_s: float
    jct_s: float  # from its first request to the end of its last turn, tool waits included
    turns: list[TurnRecord] = field(default_factory=list)


class Session(Protocol):
    """One branch of one trajectory, as a driver runs it."""

    branch: str

    def observe(self, text: str) -> None: ...

    async def complete(self, turn: TurnPlan, then: TurnPlan | None = None) -> Streamed:
        """Send ``turn``; ``then`` is the turn that follows it on this branch (None: the
        last, or a fork), whose tool wait a session may declare in this request."""
        ...

    async def pause(self, tool: str, expected_s: float | None) -> None: ...

    async def resume(self) -> str | None: ...

    def fork(self, n: int) -> list[Session]: ...

    def join(self, winner: Session) -> None: ...

    async def close(self) -> list[dict[str, Any]]: ...


class VanillaSession:
    """Plain OpenAI-compatible requests: the message list is the whole state."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        model: str,
        system_prompt: str,
        branch: str = "main",
        messages: list[dict[str, Any]] | None = None,
    ) -> None:
        self.client = client
        self.base_url = base_url
        self.model = model
        self.branch = branch
        self.messages = (
            messages if messages is not None else [{"role": "system", "content": system_prompt}]
        )
        self._forks = 0

    def observe(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    async def complete(self, turn: TurnPlan, then: TurnPlan | None = None) -> Streamed:
        body = {
            "model": self.model,
            "messages": self.messages,
            "max_tokens": turn.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        s = await stream_measured(
            self.client, self.base_url + "/v1/chat/completions", body, what="chat completion"
        )
        self.messages.append({"role": "assistant", "content": turn.action})
        return s

    async def pause(self, tool: str, expected_s: float | None) -> None:
        """Vanilla vLLM has no notion of a pause: the trajectory simply sends nothing."""

    async def resume(self) -> str | None:
        return None

    def fork(self, n: int) -> list[Session]:
        out: list[Session] = []
        for _ in range(n):
            self._forks += 1
            out.append(
                VanillaSession(
                    self.client,
                    self.base_url,
                    self.model,
                    "",
                    f"{self.branch}.{self._forks}",
                    [dict(m) for m in self.messages],
                )
            )
        return out

    def join(self, winner: Session) -> None:
        assert isinstance(winner, VanillaSession)
        self.messages = [dict(m) for m in winner.messages]

    async def close(self) -> list[dict[str, Any]]:
        return []


class AgentKVSession:
    """harness_sdk.Trajectory, with the plan's scripted action committed as the reply."""

    def __init__(self, traj: Trajectory, pause_via: PauseVia = PauseVia.ROUTES) -> None:
        self.traj = traj
        self.branch: str = traj.branch
        self.pause_via = pause_via
        self._wait: ToolWait | None = None

    @classmethod
    def open(
        cls,
        client: httpx.AsyncClient,
        base_url: str,
        model: str,
        system_prompt: str,
        trajectory_id: str,
        api_key: str | None = None,
        pause_via: PauseVia = PauseVia.ROUTES,
    ) -> AgentKVSession:
        traj = Trajectory(
            base_url,
            model,
            api_key=api_key,
            trajectory_id=trajectory_id,
            system=system_prompt,
            http_client=client,
            timeout=TIMEOUT.read or 1800.0,
        )
        traj.context = ScriptedContext(system_prompt)
        return cls(traj, pause_via)

    def observe(self, text: str) -> None:
        self.traj.observe(text)

    async def complete(self, turn: TurnPlan, then: TurnPlan | None = None) -> Streamed:
        ctx = self.traj.context
        if isinstance(ctx, ScriptedContext):
            ctx.next_action = turn.action
        # PauseVia.REQUEST: the next turn's tool wait rides on this request (then_tool), and
        # the SDK's tool() for it makes no pause or resume call.
        declared = then if self.pause_via is PauseVia.REQUEST and then and then.tool else None
        r = await self.traj.complete(
            max_tokens=turn.max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
            stream=True,
            then_tool=declared.tool if declared else None,
            then_expected_s=declared.expected_wait_s if declared else None,
        )
        return Streamed(
            r.ttft_s if r.ttft_s is not None else r.latency_s,
            r.latency_s,
            r.prompt_tokens,
            r.cached_tokens,
            r.usage.output_tokens or 0,
        )

    async def pause(self, tool: str, expected_s: float | None) -> None:
        self._wait = self.traj.tool(tool, expected_s=expected_s)
        await self._wait.__aenter__()

    async def resume(self) -> str | None:
        wait, self._wait = self._wait, None
        if wait is None:
            return None
        await wait.__aexit__(None, None, None)
        decision = wait.decision
        return str(decision.get("action")) if decision else None

    def fork(self, n: int) -> list[Session]:
        return [AgentKVSession(c, self.pause_via) for c in self.traj.fork(n)]

    def join(self, winner: Session) -> None:
        assert isinstance(winner, AgentKVSession)
        self.traj.join(winner.traj)

    async def close(self) -> list[dict[str, Any]]:
        """Fetch the server's per-turn prefix stats, then release the trajectory everywhere."""
        state = await self.traj.server_state()
        await self.traj.close()
        turns = (state or {}).get("turns") or []
        return [t for t in turns if isinstance(t, dict)]


class ScriptedContext(Context):
    """A harness_sdk Context whose ``commit_turn`` stores the plan's action as the reply.

    Set ``next_action`` before each turn; forks copy it along with the rest of the context.
    """

    next_action: str | None = None

    def commit_turn(self, reply: Mapping[str, Any]) -> None:
        if self.next_action is not None:
            reply = {"role": "assistant", "content": self.next_action}
        super().commit_turn(reply)


SessionFactory = Callable[[TrajectoryPlan, httpx.AsyncClient], Session]
Progress = Callable[[TurnRecord], None]


async def _run_turn(
    session: Session,
    turn: TurnPlan,
    tid: str,
    kind: str,
    decision: str | None,
    t_run: float,
    extra_observation: str | None = None,
    then: TurnPlan | None = None,
) -> TurnRecord:
    if extra_observation is not None:
        session.observe(extra_observation)
    sent = time.monotonic() - t_run
    s = await session.complete(turn, then)
    return TurnRecord(
        trajectory_id=tid,
        branch=session.branch,
        turn=turn.index,
        kind=kind,
        tool=turn.tool,
        wait_s=turn.wait_s,
        sent_at_s=sent,
        **asdict(s),  # the stream's TTFT, latency and token counts
        decision=decision,
    )


async def run_trajectory(
    plan: TrajectoryPlan,
    session: Session,
    t_run: float,
    on_turn: Progress | None = None,
    paused: dict[str, int] | None = None,
) -> TrajectoryRecord:
    """Run one plan on ``session``.

    ``paused`` maps the ids waiting on a tool right now to their context tokens (for the
    occupancy samples). JCT runs from the trajectory's first request to the end of its last
    turn, tool waits included.
    """
    await asyncio.sleep(max(0.0, plan.start_s - (time.monotonic() - t_run)))
    started = time.monotonic()
    rec = TrajectoryRecord(plan.trajectory_id, started - t_run, 0.0)
    try:
        for i, turn in enumerate(plan.turns):
            decision = None
            if turn.tool is not None:
                await session.pause(turn.tool, turn.expected_wait_s)
                if paused is not None:
                    last = rec.turns[-1] if rec.turns else None
                    paused[plan.trajectory_id] = (
                        last.prompt_tokens + last.completion_tokens if last else 0
                    )
                await asyncio.sleep(turn.wait_s)
                if paused is not None:
                    paused.pop(plan.trajectory_id, None)
                decision = await session.resume()
            session.observe(turn.observation)
            kind = "first" if turn.tool is None else "resume"
            if turn.fork:
                children = session.fork(turn.fork)
                done = await asyncio.gather(
                    *(
                        _run_turn(c, turn, plan.trajectory_id, kind, decision, t_run, obs)
                        for c, obs in zip(children, turn.branch_observations, strict=True)
                    )
                )
                session.join(children[0])
            else:
                # A fork's branches never declare the wait after it: the SDK's declared pause
                # is per branch, and the branches join before that wait.
                then = plan.turns[i + 1] if i + 1 < len(plan.turns) else None
                done = [
                    await _run_turn(
                        session, turn, plan.trajectory_id, kind, decision, t_run, then=then
                    )
                ]
            rec.turns.extend(done)
            if on_turn is not None:
                for d in done:
                    on_turn(d)
        rec.jct_s = time.monotonic() - started
    finally:
        stats = await session.close()
    _attach_engine_stats(rec.turns, stats)
    return rec


def _attach_engine_stats(turns: list[TurnRecord], stats: list[dict[str, Any]]) -> None:
    """Match the server's per-turn stats to records by (branch, prompt tokens), in order."""
    pending = list(stats)
    for t in turns:
        for i, s in enumerate(pending):
            if s.get("branch") == t.branch and s.get("prompt_tokens") == t.prompt_tokens:
                t.device_hit_tokens = int(s.get("device_hit_tokens") or 0)
                t.tier_hit_tokens = int(s.get("tier_hit_tokens") or 0)
                t.tier = s.get("tier")
                t.prefetch = s.get("prefetch")
                del pending[i]
                break


async def run_workload(
    workload: Workload,
    make_session: SessionFactory,
    client: httpx.AsyncClient,
    on_turn: Progress | None = None,
    paused: dict[str, int] | None = None,
    t_run: float | None = None,
) -> list[TrajectoryRecord]:
    """Every trajectory of ``workload`` at once (each waits for its start offset)."""
    t0 = time.monotonic() if t_run is None else t_run
    return list(
        await asyncio.gather(
            *(
                run_trajectory(p, make_session(p, client), t0, on_turn, paused)
                for p in workload.trajectories
            )
        )
    )
