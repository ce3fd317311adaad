"""CLI command ``agentkv diagnose``: why a trajectory's prefix-cache hit rate dropped.

Primitives:
    register        adds the ``diagnose`` command to the root app
    diagnose_cmd    trajectory JSONL + tokenizer -> terminal report, ``--json`` or ``--html FILE``
    render_html     DiagnoseReport -> a standalone HTML page with a per-turn hit-rate chart

The analysis lives in ``agentkv.diagnostics``; this module only parses options and prints.
Errors print one line on stderr and exit 2; malformed input lines are reported and skipped.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from agentkv.cli.common import fail
from agentkv.errors import AgentKVError

if TYPE_CHECKING:
    from agentkv.diagnostics import DiagnoseReport


def _chart_png(report: DiagnoseReport) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [t.turn for t in report.turns]
    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=100)
    colors = ["#d62728" if t.broken else "#2ca02c" for t in report.turns]
    ax.bar(turns, [t.h_turn for t in report.turns], color=colors, label="H_prefix per turn")
    ax.plot(
        turns,
        [t.h_cumulative for t in report.turns],
        color="#1f77b4",
        marker=".",
        label="H_prefix cumulative",
    )
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("turn")
    ax.set_ylabel("prefix hit rate")
    ax.set_title("Prefix-cache hit rate per turn (red: prefix broke)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def render_html(report: DiagnoseReport) -> str:
    """A standalone page: summary, chart (PNG as base64), per-turn table, each break's diff."""
    png = base64.b64encode(_chart_png(report)).decode("ascii")
    esc = html.escape
    rows = []
    for t in report.turns:
        d = t.divergence
        rows.append(
            "<tr>"
            f"<td>{t.turn}</td><td>{t.line_no}</td><td>{t.s_prompt}</td><td>{t.s_match}</td>"
            f"<td>{t.h_turn:.3f}</td><td>{t.h_cumulative:.3f}</td>"
            f"<td>{d.token_index if d else ''}</td><td>{esc(d.zone) if d else ''}</td>"
            f"<td>{'' if not d or d.message_index is None else d.message_index}</td>"
            f"<td>{esc(t.cause.kind) if t.cause else ''}</td></tr>"
        )
    details = []
    for t in report.breaks:
        assert t.cause is not None
        block = [
            f"<h3>Turn {t.turn} (line {t.line_no}): {esc(t.cause.kind)}</h3>",
            f"<p>{esc(t.cause.detail)}</p><p><b>Fix:</b> {esc(t.cause.fix)}</p>",
        ]
        if t.divergence:
            for label, (pre, mid, post), cls in (
                ("previous", t.divergence.prev_context, "old"),
                ("this turn", t.divergence.new_context, "new"),
            ):
                block.append(
                    f"<div>{label}:</div><pre>{esc(pre)}<span class='{cls}'>{esc(mid)}</span>"
                    f"{esc(post)}</pre>"
                )
        details.append("\n".join(block))
    errors = "".join(f"<li>line {e.line_no}: {esc(e.message)}</li>" for e in report.errors)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>agentkv diagnose</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}} pre{{background:#f6f6f6;
padding:6px;white-space:pre-wrap}} .old{{background:#fbb}} .new{{background:#bfb}}</style>
</head><body>
<h1>Prefix stability</h1>
<p>Tokenizer {esc(report.tokenizer)}, block size {report.block_size}, capacity
{report.capacity_tokens or "unlimited"} tokens. H_prefix = {report.h_prefix:.3f} over
{len(report.turns)} turns, {len(report.breaks)} break(s).</p>
<img alt="hit rate per turn" src="data:image/png;base64,{png}">
<table><tr><th>turn</th><th>line</th><th>S_prompt</th><th>S_match</th><th>H turn</th>
<th>H cumulative</th><th>divergent token</th><th>zone</th><th>message</th><th>cause</th></tr>
{"".join(rows)}</table>
{"".join(details)}
{f"<h2>Skipped lines</h2><ul>{errors}</ul>" if errors else ""}
</body></html>
"""


def _print_report(report: DiagnoseReport) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    console = Console()
    table = Table(title="Prefix-cache hit rate per turn", show_lines=False)
    for col in (
        "turn",
        "line",
        "S_prompt",
        "S_match",
        "H turn",
        "H cum.",
        "diverges at",
        "zone",
        "msg",
        "cause",
    ):
        table.add_column(col, justify="right" if col not in ("zone", "cause") else "left")
    for t in report.turns:
        d = t.divergence
        style = "red" if t.broken else None
        table.add_row(
            str(t.turn),
            str(t.line_no),
            str(t.s_prompt),
            str(t.s_match),
            f"{t.h_turn:.3f}",
            f"{t.h_cumulative:.3f}",
            str(d.token_index) if d else "",
            d.zone if d else "",
            "" if not d or d.message_index is None else str(d.message_index),
            t.cause.kind if t.cause else "",
            style=style,
        )
    console.print(table)
    for t in report.breaks:
        assert t.cause is not None
        body = Text()
        body.append(f"{t.cause.detail}\n", style="bold")
        if t.divergence:
            d = t.divergence
            body.append(
                f"token {d.token_index} ({d.prev_token} -> {d.new_token}), zone {d.zone}, "
                f"message {d.message_index if d.message_index is not None else '-'}, "
                f"char {d.char_offset} (offset {d.message_char_offset} in the message); "
                f"{d.tokens_lost} reusable tokens lost\n"
            )
            for label, (pre, mid, post), style in (
                ("- prev: ", d.prev_context, "bold white on red"),
                ("+ this: ", d.new_context, "bold black on green"),
            ):
                body.append(label, style="dim")
                body.append(pre.replace("\n", "⏎"))
                body.append(mid.replace("\n", "⏎") or "∅", style=style)
                body.append(post.replace("\n", "⏎") + "\n")
        body.append("fix: ", style="bold cyan")
        body.append(t.cause.fix)
        console.print(
            Panel(
                body, title=f"turn {t.turn} (line {t.line_no}): {t.cause.kind}", border_style="red"
            )
        )
        if t.engine_agrees is False:
            console.print(
                f"[yellow]turn {t.turn}: the engine's own statistics disagree: "
                f"{escape(json.dumps(t.engine))}[/yellow]"
            )
    for e in report.errors:
        console.print(
            f"[yellow]line {e.line_no} skipped: {escape(e.message)}[/yellow]", highlight=False
        )
    console.print(
        f"H_prefix = {report.h_prefix:.3f} over {len(report.turns)} turns "
        f"(block size {report.block_size}, capacity "
        f"{report.capacity_tokens or 'unlimited'}), {len(report.breaks)} break(s)"
    )


def register(app: typer.Typer) -> None:
    """Add this module's commands to `app`."""

    @app.command("diagnose")
    def diagnose_cmd(
        trajectory: Path = typer.Argument(
            ...,
            help="Trajectory JSONL: one chat/completions request per line ({model, messages, "
            "tools}), or the SDK trace export ({type: turn, request, response}).",
        ),
        model: Path | None = typer.Option(
            None,
            "--model",
            help="Local model folder whose tokenizer and chat template render "
            "the prompts (default: the embedded tiny model, built on first use).",
        ),
        block_size: int = typer.Option(
            128, "--block-size", min=1, help="KV block size in tokens (vLLM CPU default 128)."
        ),
        capacity_tokens: int | None = typer.Option(
            None,
            "--capacity-tokens",
            min=1,
            help="Simulated cache capacity in tokens (leaf-first LRU eviction); default unlimited.",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the report as JSON only."),
        html_file: Path | None = typer.Option(
            None, "--html", help="Also write an HTML report with a per-turn hit-rate chart here."
        ),
        context: int = typer.Option(
            60, "--context", min=0, help="Characters of context shown around each divergence."
        ),
        fail_below: float | None = typer.Option(
            None,
            "--fail-below",
            min=0.0,
            max=1.0,
            help="Exit 1 when the trajectory's H_prefix is below this (for CI).",
        ),
    ) -> None:
        """Replay a recorded trajectory through a simulated prefix cache and explain each break:
        S_prompt, S_match and H_prefix per turn, the first divergent token with its zone, and the
        cause with the fix to make."""
        report = _diagnose(trajectory, model, block_size, capacity_tokens, context)
        if html_file is not None:
            try:
                html_file.write_text(render_html(report), encoding="utf-8")
            except OSError as exc:
                fail(f"cannot write {html_file}: {exc.strerror or exc}")
        if as_json:
            out: dict[str, Any] = report.to_dict()
            if html_file is not None:
                out["html"] = str(html_file)
            typer.echo(json.dumps(out, indent=2))
        else:
            _print_report(report)
            if html_file is not None:
                typer.echo(f"wrote {html_file}")
        for e in report.errors if as_json else []:
            typer.echo(f"warning: line {e.line_no} skipped: {e.message}", err=True)
        if fail_below is not None and report.h_prefix < fail_below:
            raise typer.Exit(1)


def _diagnose(
    trajectory: Path, model: Path | None, block_size: int, capacity_tokens: int | None, context: int
) -> Any:
    """Read the trajectory and replay it with the model's tokenizer; a one-line error for an
    empty trajectory, a capacity below one block or an unreadable model."""
    from agentkv.diagnostics import diagnose, load_tokenizer, read_trajectory

    try:
        traj = read_trajectory(trajectory)
        if not traj.requests:
            first = (
                f" (line {traj.errors[0].line_no}: {traj.errors[0].message})" if traj.errors else ""
            )
            fail(f"no valid request in {trajectory}{first}")
        if capacity_tokens is not None and capacity_tokens < block_size:
            fail(f"--capacity-tokens must hold at least one block ({block_size} tokens)")
        if model is None:
            from agentkv.modelgen import ensure_model

            model_dir: Path | str = ensure_model("tiny")
        else:
            model_dir = model
        tok = load_tokenizer(model_dir)
        return diagnose(traj, tok, block_size, capacity_tokens, context)
    except AgentKVError as exc:
        fail(str(exc))
