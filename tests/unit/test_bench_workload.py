"""agentkv_bench.workload: the seeded generator (pure)."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from agentkv_bench.workload import (
    DEFAULT_TOOLS,
    TOKENS_PER_WORD,
    ToolDist,
    WorkloadConfig,
    filler,
    generate,
)

SMALL = WorkloadConfig(trajectories=4, turns=4, prefix_tokens=200, task_tokens=300, fork_prob=0.5)


def test_same_seed_same_workload() -> None:
    assert generate(SMALL) == generate(SMALL)


def test_different_seeds_differ() -> None:
    a, b = generate(SMALL), generate(replace(SMALL, seed=1))
    assert a.system_prompt != b.system_prompt
    assert [t.turns for t in a.trajectories] != [t.turns for t in b.trajectories]
    assert a.trajectories[0].trajectory_id != b.trajectories[0].trajectory_id


def test_shape_and_shared_prefix() -> None:
    w = generate(SMALL)
    assert len(w.trajectories) == 4
    assert all(len(t.turns) == 4 for t in w.trajectories)
    assert len({t.trajectory_id for t in w.trajectories}) == 4
    # One system prompt for everyone (the shared prefix); the tool catalog is in it.
    assert all(tool.name in w.system_prompt for tool in DEFAULT_TOOLS)
    # Per-trajectory content never repeats across trajectories (no accidental cross hits).
    firsts = [t.turns[0].observation for t in w.trajectories]
    assert len(set(firsts)) == len(firsts)
    for t in w.trajectories:
        first, *rest = t.turns
        assert first.tool is None and first.wait_s == 0 and first.index == 1
        assert all(u.tool in {d.name for d in DEFAULT_TOOLS} for u in rest)
        assert [u.index for u in t.turns] == [1, 2, 3, 4]
        for u in rest:
            assert SMALL.obs_min_tokens <= u.observation_tokens <= SMALL.obs_max_tokens
            assert u.max_tokens == SMALL.action_tokens
            assert len(u.branch_observations) == u.fork
            assert u.fork in (0, SMALL.fork_width)


def test_time_scale_multiplies_waits_and_stagger() -> None:
    one = generate(replace(SMALL, time_scale=1.0))
    tenth = generate(replace(SMALL, time_scale=0.1))
    for a, b in zip(one.trajectories, tenth.trajectories, strict=True):
        assert b.start_s == pytest.approx(a.start_s * 0.1)
        for u, v in zip(a.turns, b.turns, strict=True):
            assert v.wait_s == pytest.approx(u.wait_s * 0.1)
            if u.expected_wait_s is not None:
                assert v.expected_wait_s == pytest.approx(u.expected_wait_s * 0.1, rel=1e-3)
    assert tenth.total_wait_s == pytest.approx(one.total_wait_s * 0.1)
    assert generate(replace(SMALL, time_scale=0.0)).total_wait_s == 0


def test_expected_wait_is_the_tool_median_not_the_sample() -> None:
    w = generate(replace(SMALL, time_scale=1.0))
    medians = {d.name: d.median_s for d in DEFAULT_TOOLS}
    for t in w.trajectories:
        for u in t.turns[1:]:
            assert u.tool is not None
            assert u.expected_wait_s == medians[u.tool]


def test_lognormal_wait_median() -> None:
    tool = ToolDist("x", 10.0, 0.5, 1.0)
    rng = random.Random(3)
    xs = sorted(tool.sample(rng) for _ in range(4001))
    assert xs[2000] == pytest.approx(10.0, rel=0.08)
    assert all(x > 0 for x in xs)


def test_tools_by_scale_compile_tests_human() -> None:
    by = {d.name: d.median_s for d in DEFAULT_TOOLS}
    assert by["compile"] < 10 <= by["test_suite"] < 60 <= by["human_approval"]


def test_adding_trajectories_keeps_existing_ones() -> None:
    more = generate(replace(SMALL, trajectories=6))
    assert more.trajectories[:4] == generate(SMALL).trajectories


def test_no_forks_when_disabled() -> None:
    w = generate(replace(SMALL, fork_prob=0.0))
    assert all(u.fork == 0 for t in w.trajectories for u in t.turns)


@pytest.mark.parametrize(
    "bad",
    [
        {"trajectories": 0},
        {"turns": 0},
        {"time_scale": -1.0},
        {"fork_prob": 1.5},
        {"fork_width": 1},
        {"tools": ()},
    ],
)
def test_invalid_config(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        WorkloadConfig(**bad)  # type: ignore[arg-type]


def test_with_overrides_ignores_none() -> None:
    cfg = WorkloadConfig().with_overrides(trajectories=None, turns=7)
    assert cfg.turns == 7 and cfg.trajectories == WorkloadConfig().trajectories


def test_to_dict_is_json_shaped_without_text_by_default() -> None:
    d = generate(SMALL).to_dict()
    assert d["config"]["seed"] == 0 and len(d["trajectories"]) == 4
    assert "observation" not in d["trajectories"][0]["turns"][0]
    assert "system_prompt" in generate(SMALL).to_dict(with_text=True)


def test_filler_token_count_with_the_embedded_tokenizer() -> None:
    """The word-count sizing holds for the real tokenizer (when a model folder is built)."""
    from agentkv.modelgen import default_model_dir

    path = Path(default_model_dir("tiny")) / "tokenizer.json"
    if not path.is_file():
        pytest.skip("embedded tiny model not built")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    n = len(tok.encode(filler(random.Random(0), 2000)).ids)
    assert math.isclose(n, 2000, rel_tol=0.1), (n, TOKENS_PER_WORD)
