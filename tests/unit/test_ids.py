"""agentkv.ids: the one trajectory-id / branch grammar shared by params, routes and the SDK."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from agentkv.errors import ConfigError
from agentkv.ids import ID_PATTERN, MAX_ID_LEN, InvalidIdError, is_valid_id, validate_id

VALID = [
    "t1",
    "t-1",
    "main",
    "main.1.2",
    "user@example.com:run_7",
    "...",
    ".hidden",
    "..x",
    "a.",
    "-",
    "x" * MAX_ID_LEN,
]
INVALID = [
    ("a/b", "'/'"),
    ("/", "'/'"),
    ("a b", "' '"),
    ("tab\there", "'\\\\t'"),
    ("t1\n", "'\\\\n'"),
    ("", "empty"),
    ("x" * (MAX_ID_LEN + 1), "257 characters"),
    ("é", "'é'"),
    ("trajé", "position 4"),
    ("ｔ1", "'ｔ'"),  # full-width t: not ASCII
    ("a%2Fb", "'%'"),
    ("a?b", "'?'"),
    ("a#b", "'#'"),
    (".", "'.' or '..'"),
    ("..", "'.' or '..'"),
]


@pytest.mark.parametrize("value", VALID)
def test_grammar_accepts(value: str) -> None:
    assert validate_id(value) == value
    assert is_valid_id(value)
    assert re.fullmatch(ID_PATTERN, value)


@pytest.mark.parametrize(("value", "named"), INVALID)
def test_grammar_rejects_and_names_the_problem(value: str, named: str) -> None:
    assert not is_valid_id(value)
    assert not re.fullmatch(ID_PATTERN, value)
    with pytest.raises(InvalidIdError, match=named) as info:
        validate_id(value, "branch")
    assert str(info.value).startswith("branch ")
    assert isinstance(info.value, ValueError) and isinstance(info.value, ConfigError)


@pytest.mark.parametrize("value", [None, 5, b"t1", ["t1"]])
def test_non_strings_are_rejected(value: object) -> None:
    assert not is_valid_id(value)
    with pytest.raises(InvalidIdError, match="must be a string"):
        validate_id(value)


def test_pattern_is_anchored_and_matches_the_validator_everywhere() -> None:
    """ID_PATTERN works with plain ``re.match`` (anchored) and agrees with validate_id over
    every single ASCII character and the dot-only edge cases."""
    assert ID_PATTERN.startswith("^") and ID_PATTERN.endswith("$")
    assert "?<" not in ID_PATTERN and "?=" not in ID_PATTERN and "?!" not in ID_PATTERN
    assert re.match(ID_PATTERN, "ok/not") is None  # no partial match
    for code in range(128):
        for value in (chr(code), f"a{chr(code)}b"):
            assert is_valid_id(value) == (re.match(ID_PATTERN, value) is not None), value
    for n in range(1, 6):
        assert is_valid_id("." * n) == (n > 2)


def test_slash_is_excluded_so_every_valid_id_is_one_path_segment() -> None:
    allowed = {chr(c) for c in range(128) if is_valid_id(f"a{chr(c)}")}
    assert allowed == set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:@-")


def test_core_module_imports_neither_plugin_nor_sdk() -> None:
    code = (
        "import sys, agentkv.ids; bad = [m for m in sys.modules if m.split('.')[0] in "
        "('vllm', 'torch', 'agentkv_vllm', 'harness_sdk', 'pydantic')]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
