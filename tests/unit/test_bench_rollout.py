"""``agentkv bench rollout``'s own logic: the plan, the driver's history and sync contract (over
httpx's MockTransport: no server), the pools, the figures and the command line. The real
servers, the weight sync and the tiers are exercised in tests/e2e/test_weights_e2e.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from agentkv.cli import app
from agentkv_bench import rollout_run
from agentkv_bench.rollout import (
    ENV_NAME,
    FIRST_TOKEN_ID,
    RolloutShape,
    StepResult,
    TurnResult,
    context_blocks,
    plan_step,
    run_steps,
)
from agentkv_bench.rollout_report import PoolKind, compare, summarize, to_markdown, verdict
from agentkv_bench.rollout_run import default_pools

SHAPE = RolloutShape(
    trajectories=4,
    group=2,
    turns=3,
    steps=2,
    system_tokens=40,
    task_tokens=20,
    observation_tokens=10,
    output_tokens=5,
    env_median_s=0.0,
)


def test_a_step_is_the_same_plan_every_time_and_groups_share_their_task() -> None:
    a, b = plan_step(SHAPE, 0), plan_step(SHAPE, 0)
    assert a == b
    system = SHAPE.system_tokens
    prompts = [p.prompt for p in a]
    assert all(len(p) == system + SHAPE.task_tokens for p in prompts)
    assert len({p[:system] for p in prompts}) == 1  # one instruction template
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3]  # a group shares its task
    assert prompts[0] != prompts[2]
    assert all(FIRST_TOKEN_ID <= t < SHAPE.vocab for p in prompts for t in p)
    for p in a:
        assert len(p.waits_s) == len(p.observations) == SHAPE.turns - 1
        assert all(len(o) == SHAPE.observation_tokens for o in p.observations)
    assert len({p.trajectory_id for p in a}) == SHAPE.trajectories


def test_the_next_step_keeps_the_template_and_brings_new_tasks_and_trajectories() -> None:
    s0, s1 = plan_step(SHAPE, 0), plan_step(SHAPE, 1)
    system = SHAPE.system_tokens
    assert s0[0].prompt[:system] == s1[0].prompt[:system]
    assert s0[0].prompt[system:] != s1[0].prompt[system:]
    assert not {p.trajectory_id for p in s0} & {p.trajectory_id for p in s1}


def test_environment_waits_follow_the_median() -> None:
    shape = RolloutShape(trajectories=200, turns=6, env_median_s=0.5, env_sigma=0.6)
    waits = sorted(w for p in plan_step(shape, 0) for w in p.waits_s)
    assert 0.4 < waits[len(waits) // 2] < 0.6, waits[len(waits) // 2]


@pytest.mark.parametrize(
    "bad",
    [
        {"trajectories": 0},
        {"turns": 0},
        {"output_tokens": 0},
        {"system_tokens": 0, "task_tokens": 0},
        {"observation_tokens": -1},
        {"env_median_s": -1.0},
    ],
)
def test_a_shape_that_cannot_run_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RolloutShape(**bad)


def test_the_tight_pool_cannot_keep_every_context_and_the_roomy_one_can() -> None:
    shape = RolloutShape()
    pools = default_pools(shape, block_tokens=128)
    one = context_blocks(shape, 128)
    assert one == 38  # 1,024 + 512 + 5 * 32 + 4 * 768 = 4,768 tokens
    assert one < pools[PoolKind.TIGHT] < one * shape.trajectories
    assert pools[PoolKind.ROOMY] >= 2 * one * shape.trajectories
    tiny = default_pools(RolloutShape(trajectories=1, turns=1, system_tokens=1, task_tokens=0))
    assert tiny[PoolKind.TIGHT] == tiny[PoolKind.ROOMY] == 2  # one request always fits


class _FakeEngine:
    """Answers /v1/completions as vLLM streams a token-in/token-out completion: output ids
    derived from the prompt, usage with the cached tokens it is told to report."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/completions"
        body = json.loads(request.content)
        self.bodies.append(body)
        prompt = body["prompt"]
        out = [FIRST_TOKEN_ID + (len(prompt) + i) % 100 for i in range(body["max_tokens"])]
        chunks = [{"choices": [{"index": 0, "token_ids": out[:2]}]}]
        chunks.append({"choices": [{"index": 0, "token_ids": out[2:]}]})
        usage = {"prompt_tokens": len(prompt), "prompt_tokens_details": {"cached_tokens": 7}}
        chunks.append({"choices": [], "usage": usage})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})


def _drive(with_agentkv: bool) -> tuple[list[StepResult], _FakeEngine, list[int]]:
    engine = _FakeEngine()
    synced: list[int] = []

    async def sync(k: int) -> tuple[float, int | None]:
        synced.append(k)
        return 0.01, 0 if with_agentkv else None

    steps = asyncio.run(
        run_steps(
            "http://engine",
            "tiny",
            SHAPE,
            with_agentkv,
            sync,
            transport=httpx.MockTransport(engine.handler),
        )
    )
    return steps, engine, synced


def test_each_turn_sends_the_last_prompt_its_output_and_the_observation() -> None:
    steps, engine, synced = _drive(with_agentkv=True)
    assert synced == [0]  # between two steps, never after the last
    assert [s.sync_s for s in steps] == [0.01, None]
    by_traj: dict[str, list[dict[str, Any]]] = {}
    for body in engine.bodies:
        tid = body["kv_transfer_params"]["agentkv"]["trajectory_id"]
        by_traj.setdefault(tid, []).append(body)
        agentkv = body["kv_transfer_params"]["agentkv"]
        assert agentkv["implicit_pause"] is True and agentkv["env"] == ENV_NAME
        assert body["stream"] and body["return_token_ids"] and body["ignore_eos"]
    assert len(by_traj) == SHAPE.trajectories * SHAPE.steps
    plans = {p.trajectory_id: p for k in range(SHAPE.steps) for p in plan_step(SHAPE, k)}
    for tid, bodies in by_traj.items():
        plan = plans[tid]
        assert len(bodies) == SHAPE.turns
        assert bodies[0]["prompt"] == list(plan.prompt)
        for i in range(1, SHAPE.turns):
            prev = bodies[i - 1]["prompt"]
            out = [FIRST_TOKEN_ID + (len(prev) + j) % 100 for j in range(SHAPE.output_tokens)]
            assert bodies[i]["prompt"] == [*prev, *out, *plan.observations[i - 1]]
    turns = [t for s in steps for t in s.turns]
    assert len(turns) == SHAPE.trajectories * SHAPE.turns * SHAPE.steps
    assert all(t.cached_tokens == 7 and len(t.output_ids) == 5 for t in turns)
    assert all(0 < t.ttft_s <= t.latency_s for t in turns)


def test_vanilla_requests_carry_no_agentkv_params() -> None:
    _, engine, _ = _drive(with_agentkv=False)
    assert engine.bodies and all("kv_transfer_params" not in b for b in engine.bodies)


def _turn(step: int, turn: int, ttft: float, prompt: int, cached: int) -> TurnResult:
    return TurnResult(step, 0, turn, 0.0, ttft, ttft + 1, prompt, cached, [])


def test_the_figures_count_prefill_and_split_first_turns_from_resumes() -> None:
    steps = [
        StepResult(0, 10.0, [_turn(0, 1, 2.0, 100, 0), _turn(0, 2, 0.5, 200, 100)], 1.0, 0),
        StepResult(1, 8.0, [_turn(1, 1, 3.0, 100, 50), _turn(1, 2, 0.25, 200, 190)]),
    ]
    s = summarize(steps)
    assert s["prefilled_tokens"] == 600 - 340
    assert s["step_wall_median_s"] == 9.0
    assert s["resume_ttft_p50_s"] == 0.25 and s["resume_ttft_p99_s"] == 0.5
    assert s["first_ttft_p50_s"] == 2.0
    assert s["sync_s"] == [1.0] and s["tier_blocks_after_sync"] == [0]
    slower = {**s, "step_wall_median_s": 13.5, "prefilled_tokens": 520}
    r = compare(slower, s)
    assert r["step_speedup"] == 1.5 and r["prefilled_tokens"] == 2.0
    assert verdict(PoolKind.TIGHT, r["step_speedup"])["met"]
    assert not verdict(PoolKind.TIGHT, 1.29)["met"]
    assert verdict(PoolKind.ROOMY, 0.97)["met"] and not verdict(PoolKind.ROOMY, 0.96)["met"]
    assert not verdict(PoolKind.ROOMY, None)["met"]


def _report(speedup: float) -> dict[str, Any]:
    s = summarize([StepResult(0, 1.0, [_turn(0, 1, 0.1, 10, 0)])])
    return {
        "command": "agentkv bench rollout --quick",
        "started_at": "2026-12-08T00:00:00Z",
        "machine": {"cpu": "x", "cpus": 2},
        "preset": "tiny",
        "shape": {**SHAPE.__dict__},
        "pools": [
            {
                "kind": "tight",
                "num_blocks": 9,
                "configs": {"vanilla": s, "agentkv": s},
                "ratios": {**compare(s, s), "step_speedup": speedup},
                "verdict": verdict(PoolKind.TIGHT, speedup),
            }
        ],
    }


def test_the_report_says_whether_each_pool_meets_its_target() -> None:
    md = to_markdown(_report(1.42))
    assert "| tight (9 blocks) | 1.420 | >= 1.3 | yes |" in md
    assert "| tight (9 blocks) | 0.900 | >= 1.3 | no |" in to_markdown(_report(0.9))
    assert "agentkv bench rollout --quick" in md


def test_the_command_runs_the_quick_shape_and_shows_the_report(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[rollout_run.RolloutOptions] = []

    def fake(opts: rollout_run.RolloutOptions, progress: Any = None) -> dict[str, Any]:
        seen.append(opts)
        (opts.out / "report.md").write_text(to_markdown(_report(1.5)))
        return _report(1.5)

    monkeypatch.setattr(rollout_run, "run_rollout", fake)
    out = tmp_path / "r"
    out.mkdir()
    result = CliRunner().invoke(
        app, ["bench", "rollout", "--quick", "--num-blocks", ",77", "--out", str(out), "--json"]
    )
    assert result.exit_code == 0, result.output
    (opts,) = seen
    assert (opts.shape.trajectories, opts.shape.turns, opts.shape.steps) == (4, 3, 2)
    assert opts.num_blocks is not None
    assert opts.num_blocks[PoolKind.ROOMY] == 77
    assert opts.num_blocks[PoolKind.TIGHT] == default_pools(opts.shape)[PoolKind.TIGHT]
    assert json.loads(result.output)["pools"][0]["verdict"]["met"]


@pytest.mark.parametrize("blocks", ["12", "a,b", "4,100"])
def test_a_bad_pool_size_is_a_one_line_error(blocks: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["bench", "rollout", "--num-blocks", blocks, "--out", str(tmp_path)]
    )
    assert result.exit_code == 2, result.output
    assert "--num-blocks" in result.output


def test_both_servers_get_the_same_vllm_settings_and_cores(tmp_path: Path) -> None:
    """Only the connector differs. vLLM's CPU backend reserves one more core when any KV
    connector is configured, which on 2 cores gave agentkv's worker both cores and vanilla's
    one: the bench pins the reservation for both."""
    opts = rollout_run.RolloutOptions(shape=SHAPE, out=tmp_path)
    specs = {
        name: rollout_run._spec(opts, name, PoolKind.TIGHT, 40, "/m", tmp_path)
        for name in rollout_run.CONFIGS
    }
    vanilla, agentkv = specs["vanilla"], specs["agentkv"]
    assert vanilla.connector_config is None and agentkv.connector_config is not None
    assert vanilla.extra_env == agentkv.extra_env
    assert vanilla.extra_env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    for field in ("num_blocks", "kv_space_gib", "max_model_len", "extra_args", "model"):
        assert getattr(vanilla, field) == getattr(agentkv, field), field
