"""Keys: content addresses separate models, layouts, tenants and chain positions."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv.tiers.keys import BlockKey, ModelFingerprint, chain_keys

FP = ModelFingerprint("tiny", "bfloat16", 16, 4, tp_rank=0, tp_size=1, layout="NHD")


def test_chain_is_deterministic_and_hexable() -> None:
    first = chain_keys(FP, "salt", [1, 2, 3])
    again = chain_keys(ModelFingerprint("tiny", "bfloat16", 16, 4, 0, 1, "NHD"), "salt", [1, 2, 3])
    assert first == again
    assert {key: i for i, key in enumerate(first)}[again[2]] == 2
    assert len(first[0].hex()) == 32
    assert int(first[0].hex(), 16) == int.from_bytes(first[0].digest, "big")


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other"},
        {"dtype": "float16"},
        {"block_size": 32},
        {"num_layers": 5},
        {"tp_rank": 1},
        {"tp_size": 2},
        {"layout": "HND"},
    ],
)
def test_every_fingerprint_field_changes_the_keys(change: dict[str, object]) -> None:
    other = dataclasses.replace(FP, **change)  # type: ignore[arg-type]
    assert chain_keys(other, "salt", [1]) != chain_keys(FP, "salt", [1])


def test_salt_parent_and_hash_type_change_the_key() -> None:
    base = BlockKey.derive(FP, "tenant-a", 7)
    assert BlockKey.derive(FP, "tenant-b", 7) != base
    assert BlockKey.derive(FP, None, 7) != base
    assert BlockKey.derive(FP, "tenant-a", b"\x07") != base
    assert BlockKey.derive(FP, "tenant-a", 7, parent=base) != base
    assert BlockKey.derive(FP, "tenant-a", -7) != base


def test_same_block_hash_at_another_chain_position_differs() -> None:
    keys = chain_keys(FP, None, [5, 5])
    assert keys[0] != keys[1]


def test_parent_of_another_model_is_rejected() -> None:
    parent = BlockKey.derive(dataclasses.replace(FP, model_id="x"), None, 1)
    with pytest.raises(ValueError, match="fingerprint"):
        BlockKey.derive(FP, None, 2, parent=parent)


@given(
    st.lists(st.integers(min_value=-(2**63), max_value=2**64), min_size=1, max_size=6, unique=True)
)
def test_distinct_single_hashes_give_distinct_keys(hashes: list[int]) -> None:
    keys = [BlockKey.derive(FP, None, value) for value in hashes]
    assert len(set(keys)) == len(hashes)
