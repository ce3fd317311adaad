"""docs/settings.md is generated from ConnectorSettings: docs and code never differ."""

from __future__ import annotations

from pathlib import Path

from agentkv_vllm.settings import ConnectorSettings
from agentkv_vllm.settings_doc import REGENERATE, render

DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_settings_doc_matches_the_code() -> None:
    assert DOC.read_text() == render(), (
        f"docs/settings.md differs from ConnectorSettings; regenerate it: {REGENERATE}"
    )


def test_every_setting_has_a_row() -> None:
    text = render()
    for name in ConnectorSettings.model_fields:
        assert f"| `{name}` |" in text
