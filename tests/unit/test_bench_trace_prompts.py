"""Trace prompts: the prefix of every round is the session's history, exactly; sessions differ;
the oracle pool is computed from the trace; the bench sizes its pools or says why not."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from agentkv.errors import ConfigError
from agentkv.traces import TraceRound, TraceSession, TraceWorkload, parse_trace
from agentkv_bench.trace_prompts import build_prompts, oracle_blocks, session_prompts
from agentkv_bench.trace_runner import TraceBenchOptions, block_bytes_of, plan
from tests.unit.fixtures.traces import TRACELAB_SESSIONS

EXAMPLE = TRACELAB_SESSIONS  # the TraceLab 3-session example


def test_round_prefix_is_previous_prompt_plus_reply_exactly() -> None:
    w = parse_trace(EXAMPLE)
    for s, prompts in zip(w.sessions, build_prompts(w, seed=3), strict=True):
        for i, (r, p) in enumerate(zip(s.rounds, prompts, strict=True)):
            assert len(p.prompt) == r.prefix_len + r.input_len
            assert len(p.reply) == r.output_len
            if i == 0:
                continue
            history = prompts[i - 1].prompt + prompts[i - 1].reply
            assert p.prompt[: r.prefix_len] == history[: r.prefix_len]
            assert p.from_history == r.prefix_len
            # The new tokens are new: they do not continue the history where it went on.
            if r.prefix_len < len(history):
                assert p.prompt[r.prefix_len :] != history[r.prefix_len : len(p.prompt)]


def test_truncated_history_keeps_its_first_prefix_len_tokens() -> None:
    """Session 2, round 2 of the example keeps 784 of 832 history tokens (drops the reply)."""
    w = parse_trace(EXAMPLE)
    p = build_prompts(w)[2]
    assert p[2].prompt[:784] == p[1].prompt + p[1].reply[: 784 - len(p[1].prompt)]
    assert p[2].prompt[:784] == (p[1].prompt + p[1].reply)[:784]


def test_prefix_beyond_the_history_is_filled_with_new_session_content() -> None:
    s = TraceSession("s", 0.0, (TraceRound(100, 20, 5, 0.0), TraceRound(300, 10, 5, 0.0)))
    p = session_prompts(s, 0)
    assert p[0].from_history == 0 and len(p[0].prompt) == 120
    assert p[1].from_history == 125  # the whole history, then 175 new tokens of prefix
    assert p[1].prompt[:125] == p[0].context
    assert len(p[1].prompt) == 310


def test_sessions_get_distinct_content_and_ids_stay_in_range() -> None:
    w = parse_trace(EXAMPLE)
    prompts = build_prompts(w, seed=0, token_range=(16, 8192))
    blocks: set[tuple[int, ...]] = set()
    for ps in prompts:
        first = ps[0].prompt
        assert all(16 <= t < 8192 for p in ps for t in p.context)
        own = {first[i : i + 128] for i in range(0, len(first) - 127, 128)}
        assert not own & blocks  # no 128-token block shared with another session
        blocks |= own
    # Deterministic in the seed; another seed, other tokens.
    assert build_prompts(w, seed=0) == prompts
    assert build_prompts(w, seed=1)[0][0].prompt != prompts[0][0].prompt
    with pytest.raises(ValueError, match="token_range"):
        session_prompts(w.sessions[0], 0, token_range=(10, 10))


def test_oracle_blocks_cover_every_block_the_workload_fills() -> None:
    s = TraceSession("s", 0.0, (TraceRound(0, 256, 128, 0.0), TraceRound(384, 128, 1, 0.0)))
    w = TraceWorkload((s, s), "t")
    # Per session: 513 distinct tokens -> 5 blocks; generated replies 1 + 1 blocks; 2 partial.
    per_session = 5 + (1 + 1) + (1 + 1)
    assert oracle_blocks(w, 128) == math.ceil(2 * per_session * 1.1) + 16
    assert oracle_blocks(w, 128) >= 2 * 513 / 128


def _trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "t.csv"
    path.write_text(EXAMPLE)
    return path


def test_plan_sizes_pools_from_the_scaled_trace(tmp_path: Path) -> None:
    opts = TraceBenchOptions(trace=_trace_file(tmp_path), token_scale=0.5, preset="tiny")
    workload, prompts, sizing = plan(opts)
    assert workload.sessions[0].rounds[0].input_len == 256
    longest = max(r.context_len for s in workload.sessions for r in s.rounds)
    assert sizing.max_model_len >= longest and sizing.max_model_len % 128 == 0
    assert sizing.oracle_blocks == oracle_blocks(workload)
    context_blocks = math.ceil(longest / 128)
    assert sizing.num_blocks == max(2 * context_blocks + 2, sizing.oracle_blocks // 4)
    assert sizing.num_blocks < sizing.oracle_blocks  # the default pool cannot hold it all
    assert sizing.num_blocks >= sizing.max_model_len // 128 + 1
    assert sizing.block_bytes == block_bytes_of("tiny") == 4 * 2 * 2 * 64 * 128 * 2
    assert sizing.kv_space_gib * 2**30 >= sizing.oracle_blocks * sizing.block_bytes
    assert len(prompts) == 3 and len(prompts[0]) == 3
    head = plan(TraceBenchOptions(trace=opts.trace, sessions=1, preset="tiny"))[0]
    assert [s.session_id for s in head.sessions] == ["0"]


def test_plan_refuses_a_pool_smaller_than_the_longest_request(tmp_path: Path) -> None:
    opts = TraceBenchOptions(trace=_trace_file(tmp_path), num_blocks=8, preset="tiny")
    with pytest.raises(ConfigError, match=r"--num-blocks 8 cannot hold .* >= 9"):
        plan(opts)
    with pytest.raises(ConfigError, match="token_scale"):
        plan(TraceBenchOptions(trace=opts.trace, token_scale=0, preset="tiny"))
