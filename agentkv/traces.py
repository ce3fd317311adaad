"""Recorded agent workloads: TraceLab session traces parsed into one engine-agnostic plan.

Primitives:
  TraceRound        one LLM call: ``prefix_len`` tokens of prior context kept, ``input_len`` new
                    tokens appended, ``output_len`` generated, then ``wait_after_s`` (tool or
                    user time) before the session's next round
  TraceSession      one session (trajectory): id, arrival time, its rounds in order
  TraceWorkload     the sessions plus where they came from; ``scaled(token_scale, time_scale)``
                    shrinks lengths and times, ``head(n)`` keeps the first n sessions
  TraceFormatError  an AgentKVError; the message names the file, the line and the field
  load_trace(path)  -> TraceWorkload, the format detected from the content (``.gz`` is read)
  parse_trace(text, source) the same from a string
  FORMATS           the names of the formats understood

Formats (TraceLab, uw-syfi/TraceLab):
  session CSV     ``session_id,arrival_time,round_idx,prefix_len,input_len,output_len,
                  tool_wait_after_ms`` (arrival in ms; ``arrival_time`` and
                  ``tool_wait_after_ms`` may be absent: 0)
  canonical CSV   the same fields as the simulators' form, the session column named ``id``:
                  ``id,input_len,output_len,arrival_time,round_idx,tool_wait_after_ms,prefix_len``
  round JSONL     one object per round: ``session_id``, ``round_index``, ``input_tokens_total``,
                  ``prefix_tokens``, ``newly_append_tokens``, ``output_tokens``, ``tools[]``;
                  the wait after a round is the sum of its tools' ``tool_wall_latency_ms``.
                  Arrival: an ``arrival_time`` (ms) if present, else the round's earliest
                  ``timing_events[].timestamp`` relative to the trace's earliest, else 0.

The three parse to the same plan for equivalent inputs. Columns may come in any order (the
header names them); rounds of a session may come in any order (``round_idx`` sorts them).

Pure Python, no engine imports: the bench replays a plan against a server and the fleet
simulator (agentkv.simulate) consumes the same plan.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from agentkv.errors import AgentKVError

SESSION_CSV = "tracelab-session-csv"
CANONICAL_CSV = "tracelab-canonical-csv"
ROUND_JSONL = "tracelab-round-jsonl"
FORMATS: tuple[str, ...] = (SESSION_CSV, CANONICAL_CSV, ROUND_JSONL)

# Required columns of the CSV forms (the session column differs); the rest default to 0.
_CSV_REQUIRED = ("round_idx", "prefix_len", "input_len", "output_len")
_CSV_OPTIONAL = ("arrival_time", "tool_wait_after_ms")


class TraceFormatError(AgentKVError, ValueError):
    """A trace file cannot be read: the message names the file, the line and the field."""

    def __init__(self, source: str, line: int | None, field: str | None, problem: str) -> None:
        where = source if line is None else f"{source}:{line}"
        what = f" field '{field}':" if field else ""
        super().__init__(f"{where}:{what} {problem}")
        self.source = source
        self.line = line
        self.field = field
        self.problem = problem


@dataclass(frozen=True)
class TraceRound:
    """One LLM call of a session.

    The prompt is the first ``prefix_len`` tokens of the session's context so far followed by
    ``input_len`` new tokens; the call generates exactly ``output_len`` tokens. In a
    cumulative-consistent trace (TraceLab's examples are) ``prefix_len`` equals the previous
    round's ``context_len``: the whole history is kept.
    """

    prefix_len: int
    input_len: int
    output_len: int
    wait_after_s: float

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + self.input_len

    @property
    def context_len(self) -> int:
        """Tokens of context after this round: its prompt plus its reply."""
        return self.prefix_len + self.input_len + self.output_len


@dataclass(frozen=True)
class TraceSession:
    """A session (one trajectory): starts ``arrival_s`` after the trace's start."""

    session_id: str
    arrival_s: float
    rounds: tuple[TraceRound, ...]

    @property
    def max_context_len(self) -> int:
        return max(r.context_len for r in self.rounds)

    def distinct_tokens(self) -> int:
        """Token positions whose KV is ever computed for this session, counting shared ones once.

        Round i shares ``min(prefix_len, previous context)`` tokens with round i-1; the rest of
        its context is new. A cache big enough for every session's distinct tokens (rounded to
        blocks) never evicts anything the trace could reuse.
        """
        total, prev = 0, 0
        for r in self.rounds:
            total += r.context_len - min(r.prefix_len, prev)
            prev = r.context_len
        return total


@dataclass(frozen=True)
class TraceWorkload:
    """The sessions of a trace, ordered by arrival (file order breaks ties)."""

    sessions: tuple[TraceSession, ...]
    source: str
    format: str = ""

    @property
    def rounds(self) -> int:
        return sum(len(s.rounds) for s in self.sessions)

    @property
    def max_context_len(self) -> int:
        return max((s.max_context_len for s in self.sessions), default=0)

    def distinct_tokens(self) -> int:
        return sum(s.distinct_tokens() for s in self.sessions)

    def head(self, n: int) -> TraceWorkload:
        """The first ``n`` sessions by arrival."""
        if n < 1:
            raise ValueError("head(n) needs n >= 1")
        return replace(self, sessions=self.sessions[:n])

    def scaled(self, token_scale: float = 1.0, time_scale: float = 1.0) -> TraceWorkload:
        """Every length times ``token_scale``, every arrival and wait times ``time_scale``.

        Lengths stay >= 1 for inputs and outputs. A round that kept its whole history
        (``prefix_len`` == the previous context) still keeps the whole scaled history, so
        rounding never breaks a cumulative trace's prefix chain; a shorter prefix scales
        on its own and is capped at the scaled history.
        """
        if not token_scale > 0 or not math.isfinite(token_scale):
            raise ValueError(f"token_scale must be a positive number, got {token_scale}")
        if not time_scale >= 0 or not math.isfinite(time_scale):
            raise ValueError(f"time_scale must be >= 0, got {time_scale}")
        sessions: list[TraceSession] = []
        for s in self.sessions:
            rounds: list[TraceRound] = []
            prev_orig, prev_scaled = 0, 0
            for r in s.rounds:
                if r.prefix_len == prev_orig:
                    prefix = prev_scaled
                else:
                    prefix = round(r.prefix_len * token_scale)
                    if r.prefix_len < prev_orig:
                        prefix = min(prefix, prev_scaled)
                new = TraceRound(
                    prefix_len=prefix,
                    input_len=max(1, round(r.input_len * token_scale)),
                    output_len=max(1, round(r.output_len * token_scale)),
                    wait_after_s=r.wait_after_s * time_scale,
                )
                rounds.append(new)
                prev_orig, prev_scaled = r.context_len, new.context_len
            sessions.append(TraceSession(s.session_id, s.arrival_s * time_scale, tuple(rounds)))
        tag = f"{self.source} (tokens x{token_scale:g}, time x{time_scale:g})"
        return TraceWorkload(tuple(sessions), tag, self.format)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able summary (no per-round detail)."""
        return {
            "source": self.source,
            "format": self.format,
            "sessions": len(self.sessions),
            "rounds": self.rounds,
            "max_context_len": self.max_context_len,
            "distinct_tokens": self.distinct_tokens(),
            "prompt_tokens": sum(r.prompt_len for s in self.sessions for r in s.rounds),
            "output_tokens": sum(r.output_len for s in self.sessions for r in s.rounds),
            "last_arrival_s": max((s.arrival_s for s in self.sessions), default=0.0),
        }


# ---------------------------------------------------------------- parsing


@dataclass
class _Row:
    """One parsed round before sessions are assembled."""

    line: int
    session_id: str
    arrival_s: float | None
    round_idx: int
    round: TraceRound


def load_trace(path: str | Path) -> TraceWorkload:
    """Parse the trace at ``path``; the format is detected from its content."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise TraceFormatError(str(p), None, None, f"cannot read: {e.strerror or e}") from e
    if p.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise TraceFormatError(str(p), None, None, f"not a valid gzip file: {e}") from e
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise TraceFormatError(str(p), None, None, f"not UTF-8 text ({e.reason})") from e
    return parse_trace(text, str(p))


def parse_trace(text: str, source: str = "<trace>") -> TraceWorkload:
    """Parse trace ``text``; ``source`` names it in errors and in the result."""
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if not first:
        raise TraceFormatError(source, None, None, "the trace is empty")
    if first.startswith("{"):
        rows = list(_jsonl_rows(text, source))
        fmt = ROUND_JSONL
    else:
        rows, fmt = _csv_rows(text, source)
    if not rows:
        raise TraceFormatError(source, None, None, "the trace has a header but no rounds")
    return TraceWorkload(_assemble(rows, source, fmt != ROUND_JSONL), source, fmt)


def _csv_rows(text: str, source: str) -> tuple[list[_Row], str]:
    reader = csv.reader(io.StringIO(text))
    header: list[str] | None = None
    for cells in reader:
        if any(c.strip() for c in cells):
            header = [c.strip() for c in cells]
            break
    assert header is not None  # parse_trace checked there is a non-blank line
    header_line = reader.line_num
    if "session_id" in header:
        fmt, sid_col = SESSION_CSV, "session_id"
    elif "id" in header:
        fmt, sid_col = CANONICAL_CSV, "id"
    else:
        raise TraceFormatError(
            source,
            header_line,
            None,
            "not a known trace format: a CSV header needs a 'session_id' (TraceLab session "
            "CSV) or 'id' (canonical CSV) column, a JSONL trace starts with '{'; "
            f"got header {','.join(header)!r}",
        )
    for name in (sid_col, *_CSV_REQUIRED):
        if name not in header:
            raise TraceFormatError(source, header_line, name, "missing from the CSV header")
    dupes = sorted({h for h in header if header.count(h) > 1})
    if dupes:
        raise TraceFormatError(source, header_line, dupes[0], "appears twice in the CSV header")
    col = {name: header.index(name) for name in header}
    rows: list[_Row] = []
    for cells in reader:
        line = reader.line_num
        if not any(c.strip() for c in cells):
            continue
        if len(cells) != len(header):
            raise TraceFormatError(
                source, line, None, f"{len(cells)} columns, the header has {len(header)}"
            )

        def cell(name: str, cells: list[str] = cells) -> str | None:
            return cells[col[name]].strip() if name in col else None

        sid = cell(sid_col) or ""
        if not sid:
            raise TraceFormatError(source, line, sid_col, "empty session id")
        wait_ms = _num(cell("tool_wait_after_ms"), source, line, "tool_wait_after_ms")
        arrival_ms = _num(cell("arrival_time"), source, line, "arrival_time")
        output_len = _int(cell("output_len"), source, line, "output_len")
        if output_len < 1:
            raise TraceFormatError(source, line, "output_len", f"must be >= 1, got {output_len}")
        rnd = TraceRound(
            prefix_len=_int(cell("prefix_len"), source, line, "prefix_len"),
            input_len=_int(cell("input_len"), source, line, "input_len"),
            output_len=output_len,
            wait_after_s=wait_ms / 1000.0,
        )
        if rnd.prompt_len < 1:
            raise TraceFormatError(
                source, line, "input_len", "prefix_len + input_len must be >= 1 (empty prompt)"
            )
        rows.append(
            _Row(
                line,
                sid,
                arrival_ms / 1000.0,
                _int(cell("round_idx"), source, line, "round_idx"),
                rnd,
            )
        )
    return rows, fmt


def _jsonl_rows(text: str, source: str) -> Iterable[_Row]:
    parsed: list[tuple[int, Mapping[str, Any], float | None]] = []
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise TraceFormatError(source, line, None, f"invalid JSON: {e.msg}") from e
        if not isinstance(obj, dict):
            raise TraceFormatError(source, line, None, "each line must be a JSON object")
        parsed.append((line, obj, _event_time(obj, source, line)))
    first_event = min((t for _, _, t in parsed if t is not None), default=None)
    for line, obj, event_t in parsed:
        sid = obj.get("session_id")
        if not isinstance(sid, (str, int)) or isinstance(sid, bool) or str(sid) == "":
            raise TraceFormatError(source, line, "session_id", "missing or not a string")
        total = _json_int(obj, "input_tokens_total", source, line)
        prefix = _json_int(obj, "prefix_tokens", source, line)
        append = _json_int(obj, "newly_append_tokens", source, line)
        if prefix is None and append is None:
            raise TraceFormatError(
                source, line, "prefix_tokens", "missing (and so is newly_append_tokens)"
            )
        if prefix is None:
            prefix = total - append if total is not None and append is not None else 0
        if append is None:
            if total is None:
                raise TraceFormatError(
                    source, line, "newly_append_tokens", "missing (and so is input_tokens_total)"
                )
            append = total - prefix
        if total is not None and total != prefix + append:
            raise TraceFormatError(
                source,
                line,
                "input_tokens_total",
                f"{total} != prefix_tokens {prefix} + newly_append_tokens {append}",
            )
        if prefix < 0 or append < 0:
            raise TraceFormatError(source, line, "prefix_tokens", "token counts must be >= 0")
        output = _json_int(obj, "output_tokens", source, line)
        if output is None:
            raise TraceFormatError(source, line, "output_tokens", "missing")
        round_idx = _json_int(obj, "round_index", source, line)
        if round_idx is None:
            raise TraceFormatError(source, line, "round_index", "missing")
        arrival: float | None = None
        if "arrival_time" in obj:
            arrival = _num(_str(obj["arrival_time"]), source, line, "arrival_time") / 1000.0
        elif event_t is not None and first_event is not None:
            arrival = event_t - first_event
        rnd = TraceRound(
            prefix_len=prefix,
            # A recorded round may append or emit nothing (a cache-only retry); the replay
            # needs a non-empty prompt and max_tokens >= 1, as TraceLab's own CSV export does.
            input_len=append if prefix + append >= 1 else 1,
            output_len=max(1, output),
            wait_after_s=_tool_wait_ms(obj, source, line) / 1000.0,
        )
        yield _Row(line, str(sid), arrival, round_idx, rnd)


def _assemble(rows: list[_Row], source: str, same_arrival: bool) -> tuple[TraceSession, ...]:
    """Group rows into sessions ordered by arrival (first appearance breaks ties).

    A session starts at its first round's arrival. ``same_arrival``: every row repeats the
    session's start (the CSV forms) and they must agree; in the JSONL each round has its own
    event time.
    """
    by_session: dict[str, list[_Row]] = {}
    for row in rows:
        by_session.setdefault(row.session_id, []).append(row)
    sessions: list[tuple[float, int, TraceSession]] = []
    for order, (sid, srows) in enumerate(by_session.items()):
        first_line: dict[int, int] = {}
        for r in srows:
            if r.round_idx in first_line:
                raise TraceFormatError(
                    source,
                    r.line,
                    "round_idx",
                    f"session {sid!r} has round {r.round_idx} twice (first on line "
                    f"{first_line[r.round_idx]})",
                )
            first_line[r.round_idx] = r.line
        ordered = sorted(srows, key=lambda r: r.round_idx)
        start = ordered[0].arrival_s or 0.0
        if same_arrival:
            for r in ordered:
                if abs((r.arrival_s or 0.0) - start) > 1e-9:
                    raise TraceFormatError(
                        source,
                        r.line,
                        "arrival_time",
                        f"session {sid!r} starts at {start * 1000:g} ms (line "
                        f"{ordered[0].line}), this row says {(r.arrival_s or 0.0) * 1000:g} ms",
                    )
        session = TraceSession(sid, start, tuple(r.round for r in ordered))
        sessions.append((start, order, session))
    sessions.sort(key=lambda t: (t[0], t[1]))
    return tuple(s for _, _, s in sessions)


# ---------------------------------------------------------------- field readers


def _str(value: Any) -> str:
    return "" if value is None else str(value)


def _num(value: str | None, source: str, line: int, field: str) -> float:
    """A non-negative finite number; a missing or empty cell is 0."""
    if value is None or value == "":
        return 0.0
    try:
        out = float(value)
    except ValueError:
        raise TraceFormatError(source, line, field, f"expected a number, got {value!r}") from None
    if not math.isfinite(out) or out < 0:
        raise TraceFormatError(source, line, field, f"must be a finite number >= 0, got {value!r}")
    return out


def _int(value: str | None, source: str, line: int, field: str) -> int:
    """A non-negative integer (``12.0`` is accepted, ``12.5`` is not); required."""
    if value is None or value == "":
        raise TraceFormatError(source, line, field, "empty, expected an integer >= 0")
    try:
        out = float(value)
    except ValueError:
        raise TraceFormatError(
            source, line, field, f"expected an integer >= 0, got {value!r}"
        ) from None
    if not math.isfinite(out) or out < 0 or out != int(out):
        raise TraceFormatError(source, line, field, f"expected an integer >= 0, got {value!r}")
    return int(out)


def _json_int(obj: Mapping[str, Any], field: str, source: str, line: int) -> int | None:
    if field not in obj or obj[field] is None:
        return None
    value = obj[field]
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TraceFormatError(source, line, field, f"expected an integer >= 0, got {value!r}")
    return _int(str(value), source, line, field)


def _tool_wait_ms(obj: Mapping[str, Any], source: str, line: int) -> float:
    tools = obj.get("tools")
    if tools is None:
        return 0.0
    if not isinstance(tools, list):
        raise TraceFormatError(source, line, "tools", "expected a list")
    total = 0.0
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise TraceFormatError(source, line, f"tools[{i}]", "expected an object")
        total += _num(
            _str(tool.get("tool_wall_latency_ms")), source, line, f"tools[{i}].tool_wall_latency_ms"
        )
    return total


def _event_time(obj: Mapping[str, Any], source: str, line: int) -> float | None:
    """The earliest ``timing_events[].timestamp`` in seconds (ISO 8601 or epoch), if any."""
    events = obj.get("timing_events")
    if not isinstance(events, list):
        return None
    times: list[float] = []
    for i, ev in enumerate(events):
        ts = ev.get("timestamp") if isinstance(ev, dict) else None
        if ts is None:
            continue
        if isinstance(ts, (int, float)) and not isinstance(ts, bool):
            times.append(float(ts))
            continue
        try:
            times.append(datetime.fromisoformat(str(ts).replace("Z", "+00:00")).timestamp())
        except ValueError:
            raise TraceFormatError(
                source, line, f"timing_events[{i}].timestamp", f"not ISO 8601: {ts!r}"
            ) from None
    return min(times) if times else None
