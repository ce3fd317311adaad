"""A seeded agent workload: N concurrent trajectories of turns separated by tool waits.

Primitives:
  ToolDist          one tool's wait distribution: lognormal with a median and a sigma (seconds,
                    before the time scale) and a weight for how often agents call it
  WorkloadConfig    every knob of the generator; ``quick()`` is the CI smoke shape
  TurnPlan          one turn: the tool waited on before it (None on the first turn), the wait,
                    the observation the tool returned, the scripted action and max_tokens
  TrajectoryPlan    one trajectory: id, start offset, turns
  Workload          the shared system+tools prefix and the plans
  generate(config)  -> Workload; a pure function of the config (same seed, same workload)

Text is built from Python keywords and builtin names joined by spaces, which the embedded models'
tokenizer (a BPE trained on the stdlib's sources) encodes at about 1.1 tokens per word, so a
target token count becomes a word count. Every trajectory draws its own words, so no two share a
128-token block beyond the common prefix: any cache hit past the prefix is the trajectory's own.

The assistant reply committed to the history is the plan's scripted ``action``, not the
model's output: both configurations then send byte-identical prompts every turn, whatever the
(random-weight) model generated and however bf16 rounding differed between them.
"""

from __future__ import annotations

import builtins
import keyword
import math
import random
from dataclasses import asdict, dataclass, field, replace
from typing import Any

# Measured on the embedded tokenizer: 2,000 such words -> 2,203 tokens.
TOKENS_PER_WORD = 1.1
WORDS_PER_LINE = 12
VOCAB: tuple[str, ...] = tuple(
    sorted(
        set(keyword.kwlist) | {b for b in dir(builtins) if b.islower() and not b.startswith("_")}
    )
)


@dataclass(frozen=True)
class ToolDist:
    """Wait of one tool: lognormal, ``median_s`` before scaling, log-space ``sigma``."""

    name: str
    median_s: float
    sigma: float
    weight: float

    def sample(self, rng: random.Random) -> float:
        return math.exp(rng.gauss(math.log(self.median_s), self.sigma))


# A compile takes seconds, a test suite tens of seconds, a human approval minutes.
DEFAULT_TOOLS: tuple[ToolDist, ...] = (
    ToolDist("compile", 3.0, 0.5, 0.45),
    ToolDist("test_suite", 30.0, 0.5, 0.40),
    ToolDist("human_approval", 180.0, 0.6, 0.15),
)


@dataclass(frozen=True)
class WorkloadConfig:
    """Knobs of the generator. Token counts are targets (text is sized by TOKENS_PER_WORD)."""

    trajectories: int = 6
    turns: int = 5
    seed: int = 0
    time_scale: float = 0.1  # multiplies every tool wait (and the start stagger)
    prefix_tokens: int = 1500  # system prompt + tool catalog, identical for every trajectory
    task_tokens: int = 2500  # the first user message (task + repository files), per trajectory
    obs_median_tokens: int = 350  # tool output appended before each later turn: lognormal
    obs_sigma: float = 0.7
    obs_min_tokens: int = 100
    obs_max_tokens: int = 3000
    action_tokens: int = 24  # max_tokens of every turn (ignore_eos: exactly this many)
    stagger_s: float = 20.0  # trajectory i starts at i * stagger_s * time_scale
    fork_prob: float = 0.0  # chance that a turn after the first forks into fork_width branches
    fork_width: int = 2
    tools: tuple[ToolDist, ...] = DEFAULT_TOOLS

    def __post_init__(self) -> None:
        if self.trajectories < 1 or self.turns < 1:
            raise ValueError("trajectories and turns must be >= 1")
        if self.time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        if not 0 <= self.fork_prob <= 1:
            raise ValueError("fork_prob must be within [0, 1]")
        if self.fork_width < 2:
            raise ValueError("fork_width must be >= 2")
        if not self.tools or any(t.weight <= 0 or t.median_s <= 0 for t in self.tools):
            raise ValueError("tools need positive weights and medians")

    @classmethod
    def quick(cls, seed: int = 0) -> WorkloadConfig:
        """The CI smoke shape: 3 trajectories, 3 turns, sub-second waits, one fork likely."""
        return cls(
            trajectories=3,
            turns=3,
            seed=seed,
            time_scale=0.01,
            prefix_tokens=400,
            task_tokens=600,
            obs_median_tokens=150,
            obs_max_tokens=400,
            action_tokens=8,
            stagger_s=20.0,
            fork_prob=0.5,
        )

    def with_overrides(self, **changes: Any) -> WorkloadConfig:
        """A copy with the non-None ``changes`` applied."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


@dataclass(frozen=True)
class TurnPlan:
    """Turn ``index`` (1-based): wait on ``tool`` for ``wait_s``, then send ``observation``.

    ``expected_wait_s`` is what the harness declares at pause time: the tool's scaled median,
    not the sampled wait (agents know typical durations, not the future). ``fork`` > 0 makes
    the turn run on that many branches at once; the first branch's context continues.
    """

    index: int
    tool: str | None
    wait_s: float
    expected_wait_s: float | None
    observation: str
    observation_tokens: int
    action: str
    max_tokens: int
    fork: int = 0
    branch_observations: tuple[str, ...] = ()


@dataclass(frozen=True)
class TrajectoryPlan:
    trajectory_id: str
    start_s: float
    turns: tuple[TurnPlan, ...]


@dataclass(frozen=True)
class Workload:
    config: WorkloadConfig
    system_prompt: str
    trajectories: tuple[TrajectoryPlan, ...] = field(default_factory=tuple)

    def to_dict(self, with_text: bool = False) -> dict[str, Any]:
        """JSON-able summary; the (large) texts only when ``with_text``."""
        out: dict[str, Any] = {
            "config": asdict(self.config),
            "prefix_tokens_target": self.config.prefix_tokens,
            "trajectories": [
                {
                    "trajectory_id": t.trajectory_id,
                    "start_s": round(t.start_s, 3),
                    "turns": [
                        {
                            "index": u.index,
                            "tool": u.tool,
                            "wait_s": round(u.wait_s, 3),
                            "expected_wait_s": u.expected_wait_s,
                            "observation_tokens": u.observation_tokens,
                            "max_tokens": u.max_tokens,
                            "fork": u.fork,
                            **({"observation": u.observation} if with_text else {}),
                        }
                        for u in t.turns
                    ],
                }
                for t in self.trajectories
            ],
        }
        if with_text:
            out["system_prompt"] = self.system_prompt
        return out

    @property
    def total_wait_s(self) -> float:
        return sum(u.wait_s for t in self.trajectories for u in t.turns)


def words_for(tokens: int) -> int:
    return max(1, round(tokens / TOKENS_PER_WORD))


def filler(rng: random.Random, tokens: int, header: str = "") -> str:
    """About ``tokens`` tokens of seeded text in lines of WORDS_PER_LINE words."""
    words = [rng.choice(VOCAB) for _ in range(words_for(tokens))]
    lines = [" ".join(words[i : i + WORDS_PER_LINE]) for i in range(0, len(words), WORDS_PER_LINE)]
    return (header + "\n" if header else "") + "\n".join(lines)


def _system_prompt(cfg: WorkloadConfig, rng: random.Random) -> str:
    catalog = "\n".join(
        f"- {t.name}: runs for about {t.median_s:g} s; returns its output as the next message"
        for t in cfg.tools
    )
    head = (
        "You are a coding agent working in a large repository. Call one tool per turn.\n"
        f"Tools:\n{catalog}\nRepository conventions:"
    )
    return filler(rng, cfg.prefix_tokens, head)


def _pick_tool(cfg: WorkloadConfig, rng: random.Random) -> ToolDist:
    return rng.choices(cfg.tools, weights=[t.weight for t in cfg.tools])[0]


def _obs_tokens(cfg: WorkloadConfig, rng: random.Random) -> int:
    raw = math.exp(rng.gauss(math.log(cfg.obs_median_tokens), cfg.obs_sigma))
    return int(min(cfg.obs_max_tokens, max(cfg.obs_min_tokens, raw)))


def generate(cfg: WorkloadConfig) -> Workload:
    """Build the workload for ``cfg``; deterministic in ``cfg`` (its seed included).

    Each trajectory draws from its own RNG seeded by (seed, index), so adding trajectories
    does not change the existing ones.
    """
    system_prompt = _system_prompt(cfg, random.Random(f"{cfg.seed}:prefix"))
    plans: list[TrajectoryPlan] = []
    for i in range(cfg.trajectories):
        rng = random.Random(f"{cfg.seed}:traj:{i}")
        tid = f"bench-{cfg.seed}-{i}"
        turns: list[TurnPlan] = []
        for k in range(1, cfg.turns + 1):
            action = f"[{tid} turn {k}] " + filler(rng, cfg.action_tokens)
            if k == 1:
                text = filler(rng, cfg.task_tokens, f"Task {tid}: fix the failing build. Files:")
                turns.append(
                    TurnPlan(1, None, 0.0, None, text, cfg.task_tokens, action, cfg.action_tokens)
                )
                continue
            tool = _pick_tool(cfg, rng)
            wait = tool.sample(rng) * cfg.time_scale
            n = _obs_tokens(cfg, rng)
            text = filler(rng, n, f"[{tool.name} output, turn {k}]")
            fork = cfg.fork_width if rng.random() < cfg.fork_prob else 0
            branch_obs = tuple(
                filler(rng, max(cfg.obs_min_tokens, n // 2), f"[branch {b} explores]")
                for b in range(1, fork + 1)
            )
            turns.append(
                TurnPlan(
                    index=k,
                    tool=tool.name,
                    wait_s=wait,
                    expected_wait_s=round(tool.median_s * cfg.time_scale, 4),
                    observation=text,
                    observation_tokens=n,
                    action=action,
                    max_tokens=cfg.action_tokens,
                    fork=fork,
                    branch_observations=branch_obs,
                )
            )
        plans.append(TrajectoryPlan(tid, i * cfg.stagger_s * cfg.time_scale, tuple(turns)))
    return Workload(cfg, system_prompt, tuple(plans))
