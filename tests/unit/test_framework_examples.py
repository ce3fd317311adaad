"""The framework examples (examples/frameworks/, one per framework in docs/frameworks.md) are
short, parse, and answer ``--help`` with their arguments (without a server, and without
importing their framework until they run)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

FRAMEWORKS = Path(__file__).resolve().parents[2] / "examples" / "frameworks"
EXAMPLES = [
    "openai_agents_agent.py",
    "langgraph_agent.py",
    "pydantic_ai_agent.py",
    "mini_swe_agent.py",
    "smolagents_agent.py",
]


def test_every_example_is_listed() -> None:
    assert sorted(p.name for p in FRAMEWORKS.glob("*.py")) == sorted([*EXAMPLES, "common.py"])


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_is_short_and_answers_help(example: str) -> None:
    path = FRAMEWORKS / example
    source = path.read_text()
    assert len(source.splitlines()) < 80
    tree = ast.parse(source)
    assert "x-session-id" in source and "docs/frameworks.md" in (ast.get_docstring(tree) or "")
    done = subprocess.run(
        [sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    for arg in ("--base-url", "--model", "--api-key", "--session-id"):
        assert arg in done.stdout, done.stdout
