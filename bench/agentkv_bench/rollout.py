"""``agentkv bench rollout``: an RL rollout against vanilla vLLM and vLLM + agentkv, one server at
a time.

An RL trainer's rollout step: N trajectories start together (G samples per prompt, as GRPO
does), each alternating a generation with an environment step (a sandbox run, a search), for T
turns; then the trainer syncs new weights into the engine and the next step starts with new
prompts under the same instruction template. Driven as AReaL and SkyRL drive vLLM over HTTP:
token ids in (``/v1/completions`` with a token-id prompt), token ids out
(``return_token_ids``), each turn's history the previous prompt + the generated tokens + the
environment's observation. The weight sync is OpenRLHF's (``/collective_rpc`` ``update_weight``,
then a plain ``/reset_prefix_cache``) and really changes the weights
(``rollout_weights.RolloutWeightSync``).

agentkv gets the one line each framework adds (docs/rl.md): the trajectory id in
``kv_transfer_params.agentkv`` with ``implicit_pause`` and the environment's name, so each
finished turn is a pause decided from the environment's learned wait. Nothing else: no pause
or end call, connector defaults otherwise.

Primitives:
  RolloutShape          the workload's knobs (trajectories, group, turns, steps, token counts,
                        the environment step's wait distribution, seed)
  TrajectoryPlan        one trajectory of one step: its prompt, its observations and waits
  plan_step(shape, k)   -> the trajectories of step k; a pure function of (shape, k)
  TurnResult            one request's TTFT, latency, prompt and cached tokens, output ids
  StepResult            one step: its wall time, turns, the sync after it
  run_steps(...)        drive every step against one running server (async, httpx)
  context_blocks(shape) device blocks one trajectory's last turn holds (sizes the pools)
Measurement and the report: ``rollout_report``; the servers and the command: ``rollout_run``.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

# The environment step's wait, fitted to the tool waits of the public TraceLab trace
# multi_session_large.csv (255 waits: median 330 ms, quartiles 181 and 443 ms -> a log-space
# sigma of ln(443 / 181) / 1.349 = 0.66).
ENV_MEDIAN_S = 0.33
ENV_SIGMA = 0.66
ENV_NAME = "rollout_env"
FIRST_TOKEN_ID = 10  # below it: the embedded tokenizer's special and byte tokens
REQUEST_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class RolloutShape:
    """The rollout: ``trajectories`` per step in groups of ``group`` sharing one prompt,
    ``turns`` generations each with an environment step between two, ``steps`` rollout steps
    with a weight sync between two. Token counts are per turn; the instruction template
    (``system_tokens``) is the same in every step, the task (``task_tokens``) is new per group
    and step."""

    trajectories: int = 8
    group: int = 2
    turns: int = 5
    steps: int = 2
    system_tokens: int = 1024
    task_tokens: int = 512
    observation_tokens: int = 768
    output_tokens: int = 32
    env_median_s: float = ENV_MEDIAN_S
    env_sigma: float = ENV_SIGMA
    vocab: int = 8192
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("trajectories", "group", "turns", "steps", "output_tokens", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        for name in ("system_tokens", "task_tokens", "observation_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (got {getattr(self, name)})")
        if self.system_tokens + self.task_tokens < 1:
            raise ValueError("a prompt needs at least one token (system + task tokens)")
        if self.env_median_s < 0 or self.env_sigma < 0:
            raise ValueError("the environment step's median and sigma must be >= 0")
        if self.vocab <= FIRST_TOKEN_ID:
            raise ValueError(f"vocab must be > {FIRST_TOKEN_ID}")

    @property
    def final_context_tokens(self) -> int:
        """Tokens of one trajectory's context after its last generation."""
        return (
            self.system_tokens
            + self.task_tokens
            + self.turns * self.output_tokens
            + (self.turns - 1) * self.observation_tokens
        )


@dataclass(frozen=True)
class TrajectoryPlan:
    """Trajectory ``index`` of step ``step``: ``prompt`` (template + its group's task), then per
    turn after the first the environment's wait and observation (``waits_s[i]`` and
    ``observations[i]`` precede turn ``i + 2``)."""

    step: int
    index: int
    prompt: tuple[int, ...]
    waits_s: tuple[float, ...]
    observations: tuple[tuple[int, ...], ...]

    @property
    def trajectory_id(self) -> str:
        return f"rollout-s{self.step}-t{self.index}"


def _ids(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n))


def plan_step(shape: RolloutShape, step: int) -> list[TrajectoryPlan]:
    """The trajectories of rollout step ``step`` (0-based); the same (shape, step) always gives
    the same plan, so both configurations send the same prompts and wait the same waits."""
    system = _ids(random.Random(f"{shape.seed}:system"), shape.system_tokens, shape.vocab)
    plans = []
    for i in range(shape.trajectories):
        group = i // shape.group
        task = _ids(
            random.Random(f"{shape.seed}:{step}:task{group}"), shape.task_tokens, shape.vocab
        )
        rng = random.Random(f"{shape.seed}:{step}:traj{i}")
        waits = tuple(
            math.exp(rng.gauss(math.log(shape.env_median_s), shape.env_sigma))
            if shape.env_median_s > 0
            else 0.0
            for _ in range(shape.turns - 1)
        )
        observations = tuple(
            _ids(rng, shape.observation_tokens, shape.vocab) for _ in range(shape.turns - 1)
        )
        plans.append(TrajectoryPlan(step, i, system + task, waits, observations))
    return plans


def context_blocks(shape: RolloutShape, block_tokens: int) -> int:
    """Device blocks one trajectory's context holds after its last turn."""
    return math.ceil(shape.final_context_tokens / block_tokens)


@dataclass
class TurnResult:
    """One generation: when it was sent (seconds into the step), its TTFT and latency, the
    prompt's tokens and those vLLM found cached (device or an agentkv tier), the output ids."""

    step: int
    trajectory: int
    turn: int
    sent_s: float
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    output_ids: list[int] = field(repr=False)


@dataclass
class StepResult:
    """One rollout step: wall time from the first request to the last reply, its turns, then
    the weight sync after it (None after the last step) and what the tiers held after it."""

    step: int
    wall_s: float
    turns: list[TurnResult]
    sync_s: float | None = None
    tier_blocks_after_sync: int | None = None


class RolloutError(RuntimeError):
    """A request or the sync failed: the message names which and the server's answer."""


async def _generate(
    client: httpx.AsyncClient,
    model: str,
    prompt: list[int],
    max_tokens: int,
    kv_params: dict[str, Any] | None,
) -> tuple[float | None, list[int], dict[str, Any]]:
    """One streamed token-in/token-out completion: (time to the first token, the output ids,
    the usage); greedy and ``ignore_eos``, so every output is ``max_tokens`` long."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if kv_params is not None:
        body["kv_transfer_params"] = kv_params
    t0 = time.monotonic()
    ttft: float | None = None
    out: list[int] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")[:500]
            raise RolloutError(f"/v1/completions answered {r.status_code}: {text}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk.get("choices") or ():
                ids = choice.get("token_ids") or ()
                if ids and ttft is None:
                    ttft = time.monotonic() - t0
                out.extend(ids)
            usage = chunk.get("usage") or usage
    return ttft, out, usage


def agentkv_params(plan: TrajectoryPlan) -> dict[str, Any]:
    """The one line an RL framework adds (docs/rl.md): its stable trajectory id, an implicit
    pause after each turn, the environment's name (what the wait is learned under)."""
    return {
        "agentkv": {"trajectory_id": plan.trajectory_id, "implicit_pause": True, "env": ENV_NAME}
    }


async def _trajectory(
    client: httpx.AsyncClient,
    model: str,
    shape: RolloutShape,
    plan: TrajectoryPlan,
    with_agentkv: bool,
    t_step: float,
    on_turn: Callable[[TurnResult], None],
) -> list[TurnResult]:
    context = list(plan.prompt)
    kv = agentkv_params(plan) if with_agentkv else None
    results = []
    for turn in range(1, shape.turns + 1):
        if turn > 1:
            await asyncio.sleep(plan.waits_s[turn - 2])  # the environment step itself
            context.extend(plan.observations[turn - 2])
        sent = time.monotonic()
        ttft, out, usage = await _generate(client, model, context, shape.output_tokens, kv)
        latency = time.monotonic() - sent
        details = usage.get("prompt_tokens_details") or {}
        result = TurnResult(
            step=plan.step,
            trajectory=plan.index,
            turn=turn,
            sent_s=sent - t_step,
            ttft_s=latency if ttft is None else ttft,
            latency_s=latency,
            prompt_tokens=int(usage.get("prompt_tokens", len(context))),
            cached_tokens=int(details.get("cached_tokens") or 0),
            output_ids=out,
        )
        results.append(result)
        on_turn(result)
        context.extend(out)
    return results


Sync = Callable[[int], Awaitable[tuple[float, int | None]]]


async def run_steps(
    base_url: str,
    model: str,
    shape: RolloutShape,
    with_agentkv: bool,
    sync: Sync,
    on_turn: Callable[[TurnResult], None] = lambda _: None,
    headers: dict[str, str] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[StepResult]:
    """Every rollout step of ``shape`` against the server at ``base_url``; ``sync(k)`` runs the
    trainer's weight sync after step k (not after the last) and answers (its seconds, the
    agentkv tier blocks left after it, or None). ``transport``: httpx's, for tests of the
    driver's own logic."""
    limits = httpx.Limits(max_connections=max(64, shape.trajectories * 2))
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
    steps = []
    async with httpx.AsyncClient(
        base_url=base_url, timeout=timeout, limits=limits, headers=headers, transport=transport
    ) as client:
        for k in range(shape.steps):
            plans = plan_step(shape, k)
            t_step = time.monotonic()
            per_traj = await asyncio.gather(
                *(
                    _trajectory(client, model, shape, p, with_agentkv, t_step, on_turn)
                    for p in plans
                )
            )
            result = StepResult(
                step=k,
                wall_s=time.monotonic() - t_step,
                turns=[t for turns in per_traj for t in turns],
            )
            if k + 1 < shape.steps:
                result.sync_s, result.tier_blocks_after_sync = await sync(k)
            steps.append(result)
    return steps
