"""scripts/long_functions.py, the house rule's counter: a function over the limit is listed
unless a ``# long because:`` line directly above it (or above its decorators) says why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "long_functions.py"


def _body(name: str, lines: int) -> str:
    return f"def {name}() -> None:\n" + "    pass\n" * (lines - 1)


def _run(path: Path, *flags: str) -> str:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--limit", "5", *flags, str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def test_a_long_function_is_listed_unless_it_says_why(tmp_path: Path) -> None:
    src = tmp_path / "mod.py"
    src.write_text(
        _body("plain", 8)
        + "\n\n# long because: a flat option list\n"
        + _body("excused", 8)
        + "\n\n# long because: decorated\n@staticmethod\n"
        + _body("decorated", 8)
        + "\n\n# a comment that gives no reason\n"
        + _body("other_comment", 8)
        + "\n\n"
        + _body("short", 3)
    )
    listed = _run(src)
    assert "plain" in listed and "other_comment" in listed
    assert "excused" not in listed and "decorated" not in listed and "short" not in listed
    assert "2 functions over 5 lines" in listed
    excused = _run(src, "--show-excused")
    assert "excused  (a flat option list)" in excused and "decorated  (decorated)" in excused
    assert "plain" not in excused
