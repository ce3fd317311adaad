"""agentkv.traces: the three TraceLab forms parse to one plan; bad rows name line and field."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from agentkv.errors import AgentKVError
from agentkv.traces import (
    CANONICAL_CSV,
    ROUND_JSONL,
    SESSION_CSV,
    TraceFormatError,
    TraceRound,
    TraceSession,
    TraceWorkload,
    load_trace,
    parse_trace,
)
from tests.unit.fixtures.traces import TRACELAB_SESSIONS

SHARED = Path(__file__).resolve().parents[3] / "shared" / "traces"

# The TraceLab 3-session example, in its session-CSV form.
SESSION = TRACELAB_SESSIONS

CANONICAL_COLUMNS = (
    "id",
    "input_len",
    "output_len",
    "arrival_time",
    "round_idx",
    "tool_wait_after_ms",
    "prefix_len",
)


def _canonical(session_csv: str) -> str:
    """The same rows in the canonical column order (``id`` for ``session_id``), the last row
    first (round_idx orders them, not the file)."""
    header, *rows = session_csv.splitlines()
    src = header.replace("session_id", "id").split(",")
    cells = [dict(zip(src, row.split(","), strict=True)) for row in rows]
    out = [",".join(CANONICAL_COLUMNS)]
    out += [",".join(c[k] for k in CANONICAL_COLUMNS) for c in [cells[-1], *cells[:-1]]]
    return "\n".join(out) + "\n"


CANONICAL = _canonical(SESSION)


def _jsonl_rows() -> list[dict[str, object]]:
    """The example as round-trace JSONL: waits split over two tools to check the sum."""
    rows: list[dict[str, object]] = []
    starts = {
        "0": "2026-08-25T00:00:00Z",
        "1": "2026-08-25T00:00:00.200Z",
        "2": "2026-08-25T00:00:00.500Z",
    }
    for line in SESSION.splitlines()[1:]:
        sid, _arr, idx, prefix, inp, out, wait = line.split(",")
        w = int(wait)
        row: dict[str, object] = {
            "session_id": sid,
            "round_index": int(idx),
            "input_tokens_total": int(prefix) + int(inp),
            "prefix_tokens": int(prefix),
            "newly_append_tokens": int(inp),
            "output_tokens": int(out),
            "tools": [
                {"tool_name": "Bash", "tool_wall_latency_ms": w / 4},
                {"tool_name": "Read", "tool_wall_latency_ms": w - w / 4},
            ],
        }
        if idx == "0":
            row["timing_events"] = [{"event_type": "user_message", "timestamp": starts[sid]}]
        rows.append(row)
    return rows


JSONL = "\n".join(json.dumps(r) for r in _jsonl_rows()) + "\n"

EXPECTED = (
    TraceSession(
        "0",
        0.0,
        (
            TraceRound(0, 512, 64, 0.1),
            TraceRound(576, 128, 64, 0.1),
            TraceRound(768, 128, 64, 0.0),
        ),
    ),
    TraceSession("1", 0.2, (TraceRound(0, 400, 48, 0.08), TraceRound(448, 100, 48, 0.0))),
    TraceSession(
        "2",
        0.5,
        (
            TraceRound(0, 600, 64, 0.05),
            TraceRound(664, 120, 48, 0.05),
            TraceRound(784, 80, 48, 0.0),
        ),
    ),
)


def _approx_equal(a: tuple[TraceSession, ...], b: tuple[TraceSession, ...]) -> None:
    assert [s.session_id for s in a] == [s.session_id for s in b]
    for sa, sb in zip(a, b, strict=True):
        assert sa.arrival_s == pytest.approx(sb.arrival_s, abs=1e-6)
        assert len(sa.rounds) == len(sb.rounds)
        for ra, rb in zip(sa.rounds, sb.rounds, strict=True):
            assert (ra.prefix_len, ra.input_len, ra.output_len) == (
                rb.prefix_len,
                rb.input_len,
                rb.output_len,
            )
            assert ra.wait_after_s == pytest.approx(rb.wait_after_s, abs=1e-9)


@pytest.mark.parametrize(
    ("text", "fmt"),
    [(SESSION, SESSION_CSV), (CANONICAL, CANONICAL_CSV), (JSONL, ROUND_JSONL)],
    ids=["session-csv", "canonical-csv", "round-jsonl"],
)
def test_three_forms_parse_to_the_same_plan(text: str, fmt: str) -> None:
    w = parse_trace(text, "t")
    assert w.format == fmt
    _approx_equal(w.sessions, EXPECTED)


def test_load_detects_format_from_content_and_reads_gzip(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(CANONICAL)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(JSONL.encode()))
    a, b = load_trace(tmp_path / "a.txt"), load_trace(tmp_path / "b.jsonl.gz")
    assert (a.format, b.format) == (CANONICAL_CSV, ROUND_JSONL)
    assert a.source.endswith("a.txt")
    _approx_equal(a.sessions, b.sessions)


def test_shared_examples_keep_their_history() -> None:
    """The large example keeps the whole history every round (prefix == previous context);
    the small one drops one reply (session 2, round 2: prefix 784 = the previous prompt)."""
    for name, sessions, rounds, shorter in [
        ("multi_session_example.csv", 3, 8, 1),
        ("multi_session_large.csv", 48, 303, 0),
    ]:
        path = SHARED / name
        if not path.exists():
            pytest.skip(f"{path} not present")
        w = load_trace(path)
        assert (len(w.sessions), w.rounds) == (sessions, rounds)
        short = 0
        for s in w.sessions:
            prev = 0
            for r in s.rounds:
                assert r.prefix_len <= prev
                short += r.prefix_len < prev
                prev = r.context_len
        assert short == shorter
    assert w.distinct_tokens() == sum(s.rounds[-1].context_len for s in w.sessions)


def test_arrivals_sort_sessions_and_jsonl_arrival_field_wins() -> None:
    text = "session_id,arrival_time,round_idx,prefix_len,input_len,output_len\nlate,900,0,0,5,1\nearly,100,0,0,5,1\n"
    w = parse_trace(text)
    assert [s.session_id for s in w.sessions] == ["early", "late"]
    assert w.sessions[1].rounds[0].wait_after_s == 0.0  # the column is optional
    row = {"session_id": "s", "round_index": 0, "prefix_tokens": 0, "newly_append_tokens": 3}
    row |= {"output_tokens": 0, "arrival_time": 1500}
    w = parse_trace(json.dumps(row))
    assert w.sessions[0].arrival_s == 1.5
    assert w.sessions[0].rounds[0].output_len == 1  # a 0-token reply replays as max_tokens=1


def test_distinct_tokens_counts_a_truncated_history_branch() -> None:
    s = TraceSession(
        "s",
        0.0,
        (TraceRound(0, 100, 10, 0.0), TraceRound(50, 20, 10, 0.0), TraceRound(80, 5, 5, 0.0)),
    )
    # 110 + (80 - 50 shared) + (90 - 80 shared)
    assert s.distinct_tokens() == 110 + 30 + 10


def test_scaled_keeps_the_prefix_chain_and_scales_times() -> None:
    orig = parse_trace(SESSION)
    w = orig.scaled(token_scale=0.3, time_scale=2.0)
    for so, s in zip(orig.sessions, w.sessions, strict=True):
        prev_o, prev = 0, 0
        for ro, r in zip(so.rounds, s.rounds, strict=True):
            if ro.prefix_len == prev_o:
                assert r.prefix_len == prev  # rounding never breaks a whole-history chain
            else:
                assert r.prefix_len == min(prev, round(ro.prefix_len * 0.3))
            assert r.input_len >= 1 and r.output_len >= 1
            prev_o, prev = ro.context_len, r.context_len
    assert w.sessions[0].rounds[0] == TraceRound(0, round(512 * 0.3), round(64 * 0.3), 0.2)
    assert w.sessions[2].arrival_s == pytest.approx(1.0)
    assert "x0.3" in w.source
    # Tiny scales keep every round runnable.
    tiny = parse_trace(SESSION).scaled(token_scale=0.001)
    assert all(r.input_len == 1 and r.output_len == 1 for s in tiny.sessions for r in s.rounds)
    with pytest.raises(ValueError, match="token_scale"):
        parse_trace(SESSION).scaled(token_scale=0)
    with pytest.raises(ValueError, match="time_scale"):
        parse_trace(SESSION).scaled(time_scale=-1)


def test_head_keeps_first_sessions() -> None:
    w = parse_trace(SESSION)
    assert [s.session_id for s in w.head(2).sessions] == ["0", "1"]
    assert isinstance(w.head(2), TraceWorkload)


HEADER = "session_id,arrival_time,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms\n"


@pytest.mark.parametrize(
    ("body", "line", "field", "problem"),
    [
        ("0,0,0,0,512,64,100\n0,0,1,abc,128,64,0\n", 3, "prefix_len", "expected an integer"),
        ("0,0,0,0,512,-4,100\n", 2, "output_len", "integer >= 0"),
        ("0,0,0,0,512,0,100\n", 2, "output_len", ">= 1"),
        ("0,0,0,0,12.5,4,100\n", 2, "input_len", "12.5"),
        ("0,0,0,0,5,4,soon\n", 2, "tool_wait_after_ms", "expected a number"),
        ("0,0,0,0,5,4,nan\n", 2, "tool_wait_after_ms", "finite"),
        ("0,0,0,0,5,4,1\n0,0,0,9,5,4,1\n", 3, "round_idx", "twice (first on line 2)"),
        ("0,0,0,0,5,4,1\n0,30,1,9,5,4,1\n", 3, "arrival_time", "starts at 0 ms"),
        ("0,0,0,0,0,4,1\n", 2, "input_len", "empty prompt"),
        (",0,0,0,5,4,1\n", 2, "session_id", "empty session id"),
        ("0,0,0,0,5,4,1\n\n0,0,1,9,5\n", 4, None, "5 columns, the header has 7"),
    ],
)
def test_malformed_csv_rows_name_line_and_field(
    tmp_path: Path, body: str, line: int, field: str | None, problem: str
) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(HEADER + body)
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    err = info.value
    assert (err.line, err.field) == (line, field)
    assert problem in str(err)
    assert str(err).startswith(f"{path}:{line}:")
    if field:
        assert f"field '{field}'" in str(err)
    assert isinstance(err, AgentKVError)


@pytest.mark.parametrize(
    ("text", "line", "field", "problem"),
    [
        ("round_idx,prefix_len\n1,2\n", 1, None, "'session_id'"),
        ("session_id,round_idx,prefix_len,input_len\n0,0,0,1\n", 1, "output_len", "missing"),
        ("session_id,round_idx,prefix_len,input_len,output_len\n", None, None, "no rounds"),
        ("\n\n", None, None, "empty"),
        ('{"session_id": "a", "round_index": 0}\n{oops\n', 2, None, "invalid JSON"),
        (
            '{"session_id": "a", "round_index": 0, "newly_append_tokens": 5}\n',
            1,
            "output_tokens",
            "missing",
        ),
        (
            '{"session_id": "a", "round_index": 0, "input_tokens_total": 9, "prefix_tokens": 1,'
            ' "newly_append_tokens": 5, "output_tokens": 1}\n',
            1,
            "input_tokens_total",
            "9 != prefix_tokens 1 + newly_append_tokens 5",
        ),
        (
            '{"session_id": "a", "round_index": 0, "prefix_tokens": 0, "newly_append_tokens": 5,'
            ' "output_tokens": 1, "tools": [{"tool_wall_latency_ms": "x"}]}\n',
            1,
            "tools[0].tool_wall_latency_ms",
            "expected a number",
        ),
        ('{"round_index": 0}\n', 1, "session_id", "missing"),
        ("[1, 2]\n", 1, None, "not a known trace format"),
    ],
)
def test_malformed_files_name_the_problem(
    text: str, line: int | None, field: str | None, problem: str
) -> None:
    with pytest.raises(TraceFormatError) as info:
        parse_trace(text, "t.trace")
    assert (info.value.line, info.value.field) == (line, field)
    assert problem in str(info.value)


def test_missing_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="cannot read"):
        load_trace(tmp_path / "nope.csv")
