"""``agentkv diagnose`` through the CLI: terminal report, --json, --html, errors."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

from typer.testing import CliRunner

from agentkv.cli import app
from tests.unit.fixtures.diagnose_corpus import clean, inject, to_jsonl

runner = CliRunner()


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "traj.jsonl"
    path.write_text(text, encoding="utf-8")
    return path


def test_json_output_is_only_json(tmp_path: Path) -> None:
    inj = inject("truncation", turn=4, n_turns=5)
    text = to_jsonl(inj.requests)
    lines = text.splitlines()
    lines.insert(2, "{broken")
    path = _write(tmp_path, "\n".join(lines) + "\n")
    result = runner.invoke(app, ["diagnose", str(path), "--json", "--block-size", "16"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["breaks"] == {"history_rewritten": 1}
    assert data["errors"][0]["line_no"] == 3
    broken = [t for t in data["turns"] if t["cause"]]
    assert broken[0]["turn"] == 4 and broken[0]["line_no"] == 5
    assert broken[0]["divergence"]["message_index"] == 2


def test_terminal_report_and_html(tmp_path: Path) -> None:
    inj = inject("volatile_field", turn=3, n_turns=4)
    path = _write(tmp_path, to_jsonl(inj.requests) + "not json\n")
    html_path = tmp_path / "report.html"
    result = runner.invoke(
        app, ["diagnose", str(path), "--block-size", "16", "--html", str(html_path)]
    )
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "volatile_field" in out and "fix:" in out and "10:07:42" in out
    assert "line 5 skipped" in out
    page = html_path.read_text(encoding="utf-8")
    match = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert match and base64.b64decode(match.group(1)).startswith(b"\x89PNG")
    assert "volatile_field" in page and "class='new'" in page


def test_fail_below_and_clean_run(tmp_path: Path) -> None:
    path = _write(tmp_path, to_jsonl(clean(4)))
    ok = runner.invoke(app, ["diagnose", str(path), "--block-size", "16", "--fail-below", "0.5"])
    assert ok.exit_code == 0, ok.output
    low = runner.invoke(app, ["diagnose", str(path), "--block-size", "16", "--fail-below", "0.99"])
    assert low.exit_code == 1


def test_errors_are_one_line_exit_2(tmp_path: Path) -> None:
    missing = runner.invoke(app, ["diagnose", str(tmp_path / "nope.jsonl")])
    assert missing.exit_code == 2 and "error: cannot read trajectory" in missing.stderr
    assert "Traceback" not in missing.output
    empty = runner.invoke(app, ["diagnose", str(_write(tmp_path, "{bad\n"))])
    assert empty.exit_code == 2 and "line 1" in empty.stderr
    path = _write(tmp_path, to_jsonl(clean(2)))
    bad_model = runner.invoke(app, ["diagnose", str(path), "--model", str(tmp_path / "m")])
    assert bad_model.exit_code == 2 and "model folder not found" in bad_model.stderr
    cap = runner.invoke(app, ["diagnose", str(path), "--capacity-tokens", "64"])
    assert cap.exit_code == 2 and "--capacity-tokens" in cap.stderr


def test_help_documents_every_flag() -> None:
    result = runner.invoke(app, ["diagnose", "--help"], terminal_width=200)
    assert result.exit_code == 0
    for flag in (
        "--model",
        "--block-size",
        "--capacity-tokens",
        "--json",
        "--html",
        "--context",
        "--fail-below",
    ):
        assert flag in result.stdout
