"""The CLI parts commands share (agentkv/cli/bench_common.py, common.json_object), without a server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer

from agentkv.cli import bench_common
from agentkv.errors import AgentKVError


def test_bench_command_repeats_the_arguments_after_the_bench_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("sys.argv", ["agentkv", "bench", "scale", "--idle", "5", "--out", "a b"])
    assert bench_common.bench_command("scale") == "agentkv bench scale --idle 5 --out 'a b'"
    monkeypatch.setattr("sys.argv", ["pytest"])
    assert bench_common.bench_command("scale") == "agentkv bench scale"


def test_show_report_prints_the_chosen_keys_as_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[Any] = []

    def run(on_progress: Any) -> dict[str, Any]:
        on_progress("phase", 1, 2)
        seen.append(on_progress)
        return {"ratio": 1.0, "verdict": "within", "not shown": 3}

    bench_common.show_report(run, tmp_path, True, ("ratio", "verdict"))
    out = json.loads(capsys.readouterr().out)
    assert out == {"out": str(tmp_path), "ratio": 1.0, "verdict": "within"} and seen


def test_show_report_prints_report_md_without_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "report.md").write_text("# overhead\n\nratio 1.004\n")
    bench_common.show_report(lambda _: {}, tmp_path, False, ())
    captured = capsys.readouterr()
    assert "ratio 1.004" in captured.out and "report.json" in captured.err


@pytest.mark.parametrize("error", [AgentKVError("no model"), RuntimeError("server died")])
def test_a_failed_run_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], error: Exception
) -> None:
    def run(_: Any) -> dict[str, Any]:
        raise error

    with pytest.raises(typer.Exit) as exc:
        bench_common.show_report(run, tmp_path, True, ())
    assert exc.value.exit_code == 2
    assert f"error: {error}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "message"),
    [("x", "--connector-config is not JSON"), ("[1]", "--connector-config must be a JSON object")],
)
def test_a_json_object_option_is_an_object_or_one_line_error(
    text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from agentkv.cli.common import json_object

    assert json_object('{"grace_s": 1}', "--connector-config") == {"grace_s": 1}
    with pytest.raises(typer.Exit) as exc:
        json_object(text, "--connector-config")
    assert exc.value.exit_code == 2 and message in capsys.readouterr().err
