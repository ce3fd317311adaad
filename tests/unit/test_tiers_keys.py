"""Keys: the plugin's real key functions separate models, layouts, ranks, tenants and prefixes.

vLLM's block hash (its own hasher, with cache_salt in the first block's extra keys) feeds
``logical_key`` (the scheduler's) and then ``rank_key`` (each worker's): the keys production
uses, tested here end to end.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv.tiers.keys import (
    KEY_BYTES,
    BlockKey,
    ModelFingerprint,
    block_keys,
    logical_fingerprint,
    logical_key,
    rank_key,
)

vllm_kv = pytest.importorskip("vllm.v1.core.kv_cache_utils")
hashing = pytest.importorskip("vllm.utils.hashing")

BLOCK = 4
FP = ModelFingerprint("tiny", "bfloat16", 0, 4, tp_rank=0, tp_size=1, layout="NHD")
LOGICAL = logical_fingerprint("tiny", "bfloat16", BLOCK, 4, 1)


def vllm_hashes(tokens: list[int], cache_salt: str | None = None) -> list[bytes]:
    """vLLM's block hashes of a prompt, computed by vLLM's own request block hasher."""
    vllm_kv.init_none_hash(hashing.sha256_cbor)
    request: Any = SimpleNamespace(
        block_hashes=[],
        num_tokens=len(tokens),
        all_token_ids=tokens,
        mm_features=None,
        lora_request=None,
        cache_salt=cache_salt,
        prompt_embeds=None,
    )
    hasher = vllm_kv.get_request_block_hasher(BLOCK, hashing.sha256_cbor)
    return [bytes(h) for h in hasher(request)]


def keys_of(
    tokens: list[int],
    cache_salt: str | None = None,
    rank: ModelFingerprint = FP,
    logical: ModelFingerprint = LOGICAL,
) -> list[BlockKey]:
    """What a rank stores the prompt's blocks under: logical key (scheduler), then rank key."""
    lfp = logical.digest()
    return [rank_key(logical_key(h, lfp), rank.digest()) for h in vllm_hashes(tokens, cache_salt)]


PROMPT = list(range(1, 13))  # three full blocks


def test_keys_are_deterministic_and_hexable() -> None:
    first = keys_of(PROMPT, "salt")
    again = keys_of(list(PROMPT), "salt")
    assert first == again
    assert {key: i for i, key in enumerate(first)}[again[2]] == 2
    assert len(first[0].hex()) == 2 * KEY_BYTES
    assert int(first[0].hex(), 16) == int.from_bytes(first[0].digest, "big")
    assert block_keys(FP, vllm_hashes(PROMPT, "salt"), LOGICAL) == first


def test_cache_salt_separates_tenants_on_every_block() -> None:
    a = keys_of(PROMPT, "tenant-a")
    b = keys_of(PROMPT, "tenant-b")
    none = keys_of(PROMPT, None)
    # The salt enters the first block's hash; the chain carries it to every later block.
    assert not set(a) & set(b) and not set(a) & set(none) and not set(b) & set(none)


def test_a_different_prefix_changes_every_later_key() -> None:
    base = keys_of(PROMPT)
    fork = keys_of([99, *PROMPT[1:]])
    assert not set(base) & set(fork)
    same_start = keys_of([*PROMPT[:8], 7, 7, 7, 7])
    assert same_start[:2] == base[:2] and same_start[2] != base[2]


def test_the_same_tokens_at_another_chain_position_differ() -> None:
    keys = keys_of([5, 5, 5, 5, 5, 5, 5, 5])
    assert keys[0] != keys[1]


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
def test_every_rank_fingerprint_field_changes_the_keys(change: dict[str, object]) -> None:
    other = dataclasses.replace(FP, **change)  # type: ignore[arg-type]
    assert not set(keys_of(PROMPT, rank=other)) & set(keys_of(PROMPT))


@pytest.mark.parametrize(
    "change", [{"model_id": "other"}, {"dtype": "float16"}, {"num_layers": 5}, {"tp_size": 2}]
)
def test_every_logical_fingerprint_field_changes_the_keys(change: dict[str, object]) -> None:
    other = dataclasses.replace(LOGICAL, **change)  # type: ignore[arg-type]
    assert not set(keys_of(PROMPT, logical=other)) & set(keys_of(PROMPT))


def test_a_rank_key_records_the_fingerprint_it_was_derived_under() -> None:
    key = keys_of(PROMPT)[0]
    assert key.fingerprint_digest == FP.digest()
    with pytest.raises(ValueError, match="16 bytes"):
        BlockKey(b"short", FP.digest())


@given(st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=8, unique=True))
def test_distinct_block_hashes_give_distinct_keys(hashes: list[bytes]) -> None:
    keys = block_keys(FP, hashes)
    assert len(set(keys)) == len(hashes)
