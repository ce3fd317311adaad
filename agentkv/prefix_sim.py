"""A simulated paged prefix cache: what vLLM's automatic prefix caching would serve per prompt.

Primitives:
  PagedPrefixCache(block_size, capacity_tokens)   block-aligned radix of full blocks
  PagedPrefixCache.match(tokens, namespace)        tokens a prompt would be served from cache
  PagedPrefixCache.access(tokens, namespace)       match, then store the prompt's full blocks
  AccessResult                                     matched tokens, blocks stored and evicted

Semantics follow vLLM's block manager: only full blocks are cached; a block is addressed by the
chain hash of every token before it (so sharing is block-aligned and left to right); at most
``(S_prompt - 1) // block_size`` blocks can hit because the engine must compute the last prompt
token. Eviction is leaf-first LRU (the reference's radix eviction): only a block with no cached
child may go, oldest access first, and the blocks of the request being served are pinned.
``namespace`` (model name, cache salt) keeps unrelated prompts apart, as the engine does.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from agentkv.errors import ConfigError

__all__ = ["AccessResult", "PagedPrefixCache"]


@dataclass
class _Node:
    key: int
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_access: int = 0
    alive: bool = True


@dataclass(frozen=True)
class AccessResult:
    """What one prompt met in the cache."""

    prompt_tokens: int
    matched_tokens: int
    stored_blocks: int
    evicted_blocks: int


class PagedPrefixCache:
    """Block-aligned prefix cache with leaf-first LRU eviction (``capacity_tokens=None``: no limit)."""

    def __init__(self, block_size: int = 128, capacity_tokens: int | None = None) -> None:
        if block_size < 1:
            raise ConfigError(f"block size must be at least 1, got {block_size}")
        if capacity_tokens is not None and capacity_tokens < block_size:
            raise ConfigError(
                f"capacity must hold at least one block ({block_size} tokens), got {capacity_tokens}"
            )
        self.block_size = block_size
        self.capacity_blocks: int | None = (
            None if capacity_tokens is None else capacity_tokens // block_size
        )
        self._roots: dict[str, _Node] = {}
        self._clock = 0
        self._blocks = 0
        self._heap: list[tuple[int, int, _Node]] = []
        self._seq = 0

    @property
    def cached_blocks(self) -> int:
        return self._blocks

    def _root(self, namespace: str) -> _Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node(key=hash(namespace), parent=None)
        return root

    def _keys(self, tokens: Sequence[int], n_blocks: int, namespace: str) -> list[int]:
        keys: list[int] = []
        parent = hash(namespace)
        bs = self.block_size
        for i in range(n_blocks):
            parent = hash((parent, tuple(tokens[i * bs : (i + 1) * bs])))
            keys.append(parent)
        return keys

    def match(self, tokens: Sequence[int], namespace: str = "") -> int:
        """Tokens of ``tokens`` the cache would serve (block-aligned, last token excluded)."""
        n_max = max(0, (len(tokens) - 1) // self.block_size)
        node = self._roots.get(namespace)
        if node is None:
            return 0
        hits = 0
        for key in self._keys(tokens, n_max, namespace):
            child = node.children.get(key)
            if child is None:
                break
            node = child
            hits += 1
        return hits * self.block_size

    def access(self, tokens: Sequence[int], namespace: str = "") -> AccessResult:
        """Serve one prompt: count its hit, then cache its full blocks and evict to capacity."""
        matched = self.match(tokens, namespace)
        self._clock += 1
        n_full = len(tokens) // self.block_size
        if self.capacity_blocks is not None:
            n_full = min(n_full, self.capacity_blocks)
        node = self._root(namespace)
        path: set[int] = set()
        stored = 0
        for key in self._keys(tokens, n_full, namespace):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(key=key, parent=node)
                self._blocks += 1
                stored += 1
            child.last_access = self._clock
            path.add(id(child))
            node = child
        if n_full:
            self._push(node)
        evicted = self._evict(path)
        return AccessResult(len(tokens), matched, stored, evicted)

    def _push(self, node: _Node) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (node.last_access, self._seq, node))

    def _evict(self, pinned: set[int]) -> int:
        if self.capacity_blocks is None:
            return 0
        evicted = 0
        deferred: list[_Node] = []
        while self._blocks > self.capacity_blocks and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if not node.alive or node.children or node.parent is None:
                continue
            if stamp != node.last_access:
                self._push(node)  # touched since it was queued: requeue at its new age
                continue
            if id(node) in pinned:
                deferred.append(node)
                continue
            node.alive = False
            del node.parent.children[node.key]
            self._blocks -= 1
            evicted += 1
            parent = node.parent
            if parent.parent is not None and not parent.children:
                self._push(parent)  # cascading eligibility: the parent became a leaf
        for node in deferred:
            self._push(node)
        return evicted
