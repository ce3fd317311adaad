"""The simulated paged prefix cache: block-aligned hits, leaf-first LRU eviction."""

from __future__ import annotations

import pytest

from agentkv.errors import ConfigError
from agentkv.prefix_sim import PagedPrefixCache


def test_hits_are_block_aligned_and_exclude_the_last_token() -> None:
    cache = PagedPrefixCache(block_size=4)
    first = cache.access(list(range(10)))
    assert first.matched_tokens == 0 and first.stored_blocks == 2  # the partial block is not cached
    assert cache.match(list(range(10))) == 8
    assert cache.match(list(range(8))) == 4  # vLLM computes the last prompt token
    assert cache.match([*range(6), 99, 7, 8, 9]) == 4  # diverges inside block 2
    assert cache.match([99, *range(1, 10)]) == 0
    assert cache.match(list(range(10)), namespace="other-model") == 0


def test_leaf_first_lru_eviction_keeps_the_shared_head() -> None:
    cache = PagedPrefixCache(block_size=2, capacity_tokens=8)  # 4 blocks
    head = [1, 2, 3, 4]
    cache.access([*head, 10, 11])  # 3 blocks
    cache.access([*head, 20, 21])  # 4 blocks: head shared
    assert cache.cached_blocks == 4
    cache.access([*head, 30, 31])  # one leaf must go: the oldest, [10, 11]
    assert cache.cached_blocks == 4
    assert cache.match([*head, 10, 11, 0]) == 4
    assert cache.match([*head, 20, 21, 0]) == 6
    assert cache.match([*head, 30, 31, 0]) == 6
    # A long new prompt evicts leaves first and interior blocks only once they became leaves.
    result = cache.access([7, 7, 8, 8, 9, 9, 0])
    assert result.evicted_blocks == 3
    assert cache.match([7, 7, 8, 8, 9, 9, 0]) == 6
    assert cache.match([*head, 30, 31, 0]) == 2  # leaves went first, then [3, 4]; [1, 2] stays


def test_prompt_longer_than_the_cache_keeps_its_head() -> None:
    cache = PagedPrefixCache(block_size=2, capacity_tokens=4)
    cache.access(list(range(20)))
    assert cache.cached_blocks == 2
    assert cache.match(list(range(20))) == 4


def test_bad_sizes_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        PagedPrefixCache(block_size=0)
    with pytest.raises(ConfigError):
        PagedPrefixCache(block_size=16, capacity_tokens=8)
