"""Prefix-stability analysis over a generated corpus: each injected cause is found at the right
turn, token zone and message; a clean trajectory keeps its prefix; malformed lines are skipped."""

from __future__ import annotations

import json

import pytest

from agentkv.diagnostics import (
    HFChatTokenizer,
    diagnose,
    load_tokenizer,
    load_trajectory,
    render_request,
    zone_of,
)
from agentkv.modelgen import ensure_model
from tests.unit.fixtures.diagnose_corpus import KINDS, clean, inject, to_jsonl

BS = 16


@pytest.fixture(scope="module")
def tok() -> HFChatTokenizer:
    return load_tokenizer(ensure_model("tiny"))


@pytest.mark.parametrize("kind", KINDS)
def test_injected_cause_found_at_the_right_position(tok: HFChatTokenizer, kind: str) -> None:
    inj = inject(kind, turn=5)
    report = diagnose(load_trajectory(to_jsonl(inj.requests).splitlines()), tok, block_size=BS)
    assert [t.turn for t in report.breaks] == [inj.turn]
    turn = report.turns[inj.turn - 1]
    assert turn.cause is not None and turn.divergence is not None
    assert turn.cause.kind == inj.cause, turn.cause
    assert inj.detail in turn.cause.detail
    assert turn.cause.fix
    d = turn.divergence
    assert (d.zone, d.message_index) == (inj.zone, inj.message_index)
    # The divergent token really is the first one that differs from the previous prompt.
    prev = render_request(tok, inj.requests[inj.turn - 2])
    cur = render_request(tok, inj.requests[inj.turn - 1])
    if kind != "model_switch":
        assert prev.token_ids[: d.token_index] == cur.token_ids[: d.token_index]
        assert prev.token_ids[d.token_index] != cur.token_ids[d.token_index]
    assert zone_of(cur, d.char_offset)[:2] == (d.zone, d.message_index)
    # The break costs hits: this turn matches at most what precedes the divergence.
    assert turn.s_match <= (d.token_index // BS) * BS
    assert d.tokens_lost > 0 or kind == "tokenization_boundary"
    assert turn.h_turn < report.turns[inj.turn - 2].h_turn or d.zone != "system"


def test_clean_trajectory_keeps_its_prefix(tok: HFChatTokenizer) -> None:
    report = diagnose(load_trajectory(to_jsonl(clean(16)).splitlines()), tok, block_size=BS)
    assert report.breaks == [] and report.errors == []
    first, *rest = report.turns
    assert first.s_match == 0
    for prev, t in zip(report.turns, rest, strict=False):
        # every block the previous prompt filled is served from cache
        assert t.s_match == t.s_reusable == (prev.s_prompt // BS) * BS
        assert t.divergence is None
    assert rest[-1].h_turn > 0.9
    later = sum(t.s_match for t in rest) / sum(t.s_prompt for t in rest)
    assert later > 0.85


def test_capacity_eviction_is_reported_as_such(tok: HFChatTokenizer) -> None:
    report = diagnose(
        load_trajectory(to_jsonl(clean(8)).splitlines()), tok, block_size=BS, capacity_tokens=640
    )
    kinds = {t.cause.kind for t in report.breaks if t.cause}
    assert kinds == {"capacity_eviction"}
    assert all(t.divergence is None for t in report.breaks)


def test_malformed_lines_are_reported_and_skipped(tok: HFChatTokenizer) -> None:
    lines = to_jsonl(clean(4)).splitlines()
    lines.insert(1, "{not json")
    lines.insert(3, json.dumps({"model": "tiny"}))
    lines.insert(4, "[1, 2]")
    lines.insert(5, "")
    lines.insert(6, json.dumps({"model": "tiny", "messages": [{"content": "no role"}]}))
    traj = load_trajectory(lines)
    assert [e.line_no for e in traj.errors] == [2, 4, 5, 7]
    assert "invalid JSON" in traj.errors[0].message
    assert "messages" in traj.errors[1].message
    report = diagnose(traj, tok, block_size=BS)
    assert len(report.turns) == 4 and report.breaks == []
    assert [t.line_no for t in report.turns] == [1, 3, 8, 9]


def test_sdk_trace_export_and_engine_stats(tok: HFChatTokenizer) -> None:
    inj = inject("volatile_field", turn=3, n_turns=4)
    ids = [render_request(tok, r).token_ids for r in inj.requests]
    lines = [json.dumps({"type": "span", "name": "pause"})]
    for i, req in enumerate(inj.requests):
        stats: dict[str, object] = {"turn": i + 1, "prompt_tokens": len(ids[i])}
        if i:
            n = 0
            while n < len(ids[i - 1]) and ids[i - 1][n] == ids[i][n]:
                n += 1
            stats["first_divergence_token"] = n if n < len(ids[i - 1]) else None
        lines.append(
            json.dumps(
                {
                    "type": "turn",
                    "request": req,
                    "response": {"kv_transfer_params": {"agentkv": stats}},
                }
            )
        )
    report = diagnose(load_trajectory(lines), tok, block_size=BS)
    assert [t.line_no for t in report.turns] == [2, 3, 4, 5]
    assert [t.turn for t in report.breaks] == [3]
    assert all(t.engine is not None for t in report.turns)
    assert [t.engine_agrees for t in report.turns[1:]] == [True, True, True]
    # an engine that saw another prompt length disagrees
    bad = json.loads(lines[2])
    bad["response"]["kv_transfer_params"]["agentkv"]["prompt_tokens"] += 5
    lines[2] = json.dumps(bad)
    report = diagnose(load_trajectory(lines), tok, block_size=BS)
    assert report.turns[1].engine_agrees is False


def test_report_dict_is_json(tok: HFChatTokenizer) -> None:
    inj = inject("tools_added", turn=3, n_turns=4)
    out = diagnose(
        load_trajectory(to_jsonl(inj.requests).splitlines()), tok, block_size=BS
    ).to_dict()
    data = json.loads(json.dumps(out))
    assert data["breaks"] == {"tools_changed": 1}
    assert data["turns"][2]["divergence"]["zone"] == "tools"
    assert 0 < data["h_prefix"] < 1
