from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentkv import modelgen
from agentkv.errors import ConfigError

pytest.importorskip("transformers")


def test_build_is_deterministic_and_offline(tmp_path: Path) -> None:
    a = modelgen.build_model("tiny", tmp_path / "a")
    b = modelgen.build_model("tiny", tmp_path / "b")
    assert modelgen.weights_digest(a) == modelgen.weights_digest(b)
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 4 and cfg["num_key_value_heads"] == 2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(a))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|assistant|>\n") and "<|user|>\nhi<|end|>" in text
    assert modelgen.is_complete(a, modelgen.PRESETS["tiny"])
    # reused, not rebuilt
    assert modelgen.ensure_model("tiny", a) == a


def test_unknown_preset() -> None:
    with pytest.raises(ConfigError, match="unknown preset"):
        modelgen.get_preset("huge")
