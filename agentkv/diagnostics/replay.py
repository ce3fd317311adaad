"""The replay: every prompt of a trajectory through a simulated prefix cache, each break explained.

Primitives:
  diagnose(traj, tok, ...)  DiagnoseReport: per-turn S_prompt, S_match, H_prefix, divergence, cause
  DiagnoseReport            the turns, the malformed lines, H_prefix, ``to_dict`` (the JSON report)
  TurnReport                one turn's numbers, its Divergence and Cause, and whether the engine's
                            own statistics agree
  Divergence                the first token at which a prompt leaves the previous one: zone,
                            message, the two tokens and the text around each

Each prompt is rendered with the model's chat template, tokenized, and replayed through
``prefix_sim.PagedPrefixCache``. The first divergent token is the token-level longest common
prefix with the previous turn's prompt.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from agentkv.diagnostics.causes import Cause, cause_of, classify
from agentkv.diagnostics.prompts import (
    ChatTokenizer,
    RenderedPrompt,
    lcp,
    lcp_str,
    render_request,
    zone_of,
)
from agentkv.diagnostics.trajectory import LineError, Trajectory, TrajectoryRequest
from agentkv.prefix_sim import PagedPrefixCache


@dataclass
class Divergence:
    """The first token at which a prompt leaves the previous turn's prompt."""

    token_index: int
    zone: str
    message_index: int | None
    char_offset: int  # in the rendered prompt
    message_char_offset: int  # inside the message content (or the tool list)
    prev_token: int | None
    new_token: int | None
    prev_context: tuple[str, str, str]  # before, differing part, after (previous prompt)
    new_context: tuple[str, str, str]  # the same for this prompt
    tokens_lost: int  # reusable tokens the break cost, block-aligned


@dataclass
class TurnReport:
    turn: int
    line_no: int
    model: str
    s_prompt: int
    s_match: int
    s_reusable: int  # block-aligned tokens this prompt shares with the previous one
    h_turn: float
    h_cumulative: float
    divergence: Divergence | None = None
    cause: Cause | None = None
    engine: dict[str, Any] | None = None
    engine_agrees: bool | None = None

    @property
    def broken(self) -> bool:
        return self.cause is not None


@dataclass
class DiagnoseReport:
    tokenizer: str
    block_size: int
    capacity_tokens: int | None
    turns: list[TurnReport]
    errors: list[LineError]

    @property
    def h_prefix(self) -> float:
        total = sum(t.s_prompt for t in self.turns)
        return sum(t.s_match for t in self.turns) / total if total else 0.0

    @property
    def breaks(self) -> list[TurnReport]:
        return [t for t in self.turns if t.broken]

    def to_dict(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for t in self.breaks:
            assert t.cause is not None
            counts[t.cause.kind] = counts.get(t.cause.kind, 0) + 1
        return {
            "tokenizer": self.tokenizer,
            "block_size": self.block_size,
            "capacity_tokens": self.capacity_tokens,
            "turns": [asdict(t) for t in self.turns],
            "h_prefix": round(self.h_prefix, 6),
            "s_prompt_total": sum(t.s_prompt for t in self.turns),
            "s_match_total": sum(t.s_match for t in self.turns),
            "breaks": counts,
            "errors": [asdict(e) for e in self.errors],
        }


def _context(text: str, start: int, end: int, width: int) -> tuple[str, str, str]:
    return text[max(0, start - width) : start], text[start:end], text[end : end + width]


def _engine_agrees(engine: dict[str, Any], report: TurnReport) -> bool | None:
    prompt = engine.get("prompt_tokens")
    if isinstance(prompt, int) and prompt != report.s_prompt:
        return False
    if "first_divergence_token" not in engine:
        return None if not isinstance(prompt, int) else True
    ours = report.divergence.token_index if report.divergence else None
    theirs = engine.get("first_divergence_token")
    if report.cause is not None and report.cause.kind in ("model_switch", "capacity_eviction"):
        return None
    return ours == theirs


def diagnose(
    trajectory: Trajectory,
    tokenizer: ChatTokenizer,
    block_size: int = 128,
    capacity_tokens: int | None = None,
    context_chars: int = 60,
) -> DiagnoseReport:
    """Replay every request through a simulated prefix cache and explain each break."""
    cache = PagedPrefixCache(block_size, capacity_tokens)
    errors = list(trajectory.errors)
    turns: list[TurnReport] = []
    prev: tuple[TrajectoryRequest, RenderedPrompt] | None = None
    sum_prompt = sum_match = 0
    for req in trajectory.requests:
        try:
            rendered = render_request(tokenizer, req.request)
        except Exception as exc:  # a template error is the input's fault: report and skip
            errors.append(LineError(req.line_no, f"chat template failed: {exc}"))
            continue
        ids = rendered.token_ids
        namespace = f"{req.model}\x00{req.request.get('cache_salt') or ''}"
        result = cache.access(ids, namespace)
        sum_prompt += len(ids)
        sum_match += result.matched_tokens
        report = TurnReport(
            turn=len(turns) + 1,
            line_no=req.line_no,
            model=req.model,
            s_prompt=len(ids),
            s_match=result.matched_tokens,
            s_reusable=0,
            h_turn=round(result.matched_tokens / len(ids), 6) if ids else 0.0,
            h_cumulative=round(sum_match / sum_prompt, 6) if sum_prompt else 0.0,
            engine=req.engine,
        )
        if prev is not None:
            p_req, p_r = prev
            reusable = (min(len(p_r.token_ids), len(ids) - 1) // block_size) * block_size
            d = lcp(p_r.token_ids, ids)
            if p_req.model != req.model:
                d = 0
            report.s_reusable = (min(d, len(ids) - 1) // block_size) * block_size
            if d < len(p_r.token_ids) and d < len(ids):
                cause = classify(p_req, req, p_r, rendered, d)
                lost = max(0, reusable - result.matched_tokens)
                report.divergence = _divergence(p_r, rendered, d, context_chars, lost)
                report.cause = cause
            elif result.matched_tokens < reusable:
                report.cause = cause_of(
                    "capacity_eviction",
                    f"prompt unchanged but only {result.matched_tokens} of {reusable} reusable "
                    "tokens were still cached",
                )
        if req.engine:
            report.engine_agrees = _engine_agrees(req.engine, report)
        turns.append(report)
        prev = (req, rendered)
    errors.sort(key=lambda e: e.line_no)
    return DiagnoseReport(tokenizer.name, block_size, capacity_tokens, turns, errors)


def _divergence(
    prev: RenderedPrompt, new: RenderedPrompt, d: int, context_chars: int, tokens_lost: int
) -> Divergence:
    """Where ``new`` leaves ``prev`` at token ``d``: its zone and message, the two tokens and
    ``context_chars`` of text around each side."""
    c_new = new.offsets[d][0]
    zone, k, off = zone_of(new, c_new)
    c = lcp_str(prev.text, new.text)
    a_start, a_end = prev.offsets[d]
    b_start, b_end = new.offsets[d]
    return Divergence(
        token_index=d,
        zone=zone,
        message_index=k,
        char_offset=c_new,
        message_char_offset=off,
        prev_token=prev.token_ids[d],
        new_token=new.token_ids[d],
        prev_context=_context(
            prev.text, a_start, max(a_end, min(c + 1, len(prev.text))), context_chars
        ),
        new_context=_context(
            new.text, b_start, max(b_end, min(c + 1, len(new.text))), context_chars
        ),
        tokens_lost=tokens_lost,
    )
