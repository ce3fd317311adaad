"""How a replica gives device blocks to requests: whole requests, or vLLM's chunks with
recompute preemption.

Primitives:
  Admission         WHOLE | CHUNK (see each member)
  AdmissionMixin    the replica's block operations for CHUNK admission: ``_first_blocks`` (what
                    admission allocates), ``_prompt_fits`` (vLLM 0.32's full-prompt check),
                    ``_grow`` (blocks for the tokens a segment computes), ``_preempt``
                    (recompute preemption), ``_reserve`` (a segment's blocks, preempting the
                    newest request when one does not fit)

Kept apart from replica.py so the engine loop and the block policy read separately; the mixin
uses the replica's pool, queues and costs (``Replica`` is its only user).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING

from agentkv.simulate.pool import PREFIX, BlockPool

if TYPE_CHECKING:
    from agentkv.simulate.costs import EngineCosts
    from agentkv.simulate.replica import Request

_HEAD, _FILL = 1, 2  # segment kinds: the head's chunks, one mixed fill step


class Admission(StrEnum):
    """How a replica gives blocks to requests."""

    WHOLE = "whole"
    """A request waits until its whole prompt and output fit; nothing is ever preempted."""
    CHUNK = "chunk"
    """vLLM 0.32's V1 scheduler: a request is admitted when its whole prompt fits in the free
    blocks (``scheduler_reserve_full_isl``), but takes them chunk by chunk as its prefill
    runs, and decode tokens take blocks as they go; when a running request cannot get one, the
    most recently admitted request is preempted (its blocks freed, still cached, and it goes
    back to the head of the waiting queue to recompute what was evicted)."""


class AdmissionMixin:
    """Block operations of CHUNK admission (see the module docstring)."""

    admission: Admission
    bt: int
    costs: EngineCosts
    pool: BlockPool
    waiting: deque[Request]
    prefilling: list[Request]
    decoding: list[Request]
    pending_prefill_s: float
    preemptions: int
    _no_admit: bool
    _forget_request: Callable[[Request], None]  # ForkMixin's

    def _demote_for(self, excess: float) -> None:
        raise NotImplementedError

    def _first_blocks(self, r: Request, hit_blocks: int) -> int:
        """Blocks a request needs to be admitted: all of them (WHOLE), or its hits plus its
        first prefill chunk (CHUNK, as vLLM V1's scheduler allocates)."""
        if self.admission is Admission.WHOLE:
            return r.total_blocks
        tokens = min(r.prompt, hit_blocks * self.bt + self.costs.max_batched_tokens)
        return min(r.total_blocks, max(hit_blocks, -(-tokens // self.bt)))

    def _prompt_fits(self, r: Request, pre: int, priv: int) -> bool:
        """CHUNK admission: vLLM 0.32's ``scheduler_reserve_full_isl`` (on by default) admits
        a request only when its whole prompt fits in the free blocks (cached-free included),
        though it allocates them chunk by chunk (WHOLE: ``admit`` checks prompt and output)."""
        if self.admission is Admission.WHOLE:
            return True
        pool = self.pool
        in_lru = pool.lru.get(r.tid, 0) + (pool.lru.get(PREFIX + r.group, 0) if pre else 0)
        need = -(-r.prompt // self.bt) - pre - priv
        return need <= pool.empty + pool.cached_free - min(in_lru, pre + priv)

    def _grow(self, r: Request, tokens: int) -> bool:
        """Give a running request blocks for ``tokens`` tokens; False when the pool has none.
        The one pool operation chunked admission needs beyond BlockPool's API (a grown
        allocation is released like any other)."""
        assert r.alloc is not None
        need = min(r.total_blocks, -(-tokens // self.bt)) - r.alloc.blocks
        if need <= 0:
            return True
        pool = self.pool
        if pool.empty + pool.cached_free < need:
            return False
        if need > pool.empty:
            pool._evict(need - pool.empty)
        pool.active += need
        pool.filled += need
        r.alloc.blocks += need
        return True

    def _preempt(self, r: Request) -> None:
        """vLLM's recompute preemption: free the request's blocks (its computed full blocks
        stay cached for its return) and put it back at the head of the waiting queue."""
        assert r.alloc is not None
        if r in self.prefilling:
            self.prefilling.remove(r)
            self.pending_prefill_s -= self.costs.prefill_s(r.remaining, r.computed)
        else:
            self.decoding.remove(r)
        keep = r.computed // self.bt - r.prefix_blocks
        self.pool.release(r.tid, r.group, r.alloc, keep)
        self._forget_request(r)
        r.alloc = None
        r.reusable_tokens = max(r.reusable_tokens, r.computed)
        r.preempted += 1
        self.preemptions += 1
        self._no_admit = True
        r.estimate_s = self.costs.prefill_s(r.prompt, 0)
        self.pending_prefill_s += r.estimate_s
        self.waiting.appendleft(r)

    def _reserve(self, kind: int, steps: int) -> bool:
        """Blocks for every token the planned segment computes (CHUNK admission); when one
        does not fit, preempt the most recently admitted request and say so (replan)."""
        budget = self.costs.max_batched_tokens - len(self.decoding)
        wants: list[tuple[Request, int]] = [
            (d, d.prompt + d.output - d.decode_left + steps) for d in self.decoding
        ]
        if kind == _HEAD:
            head = self.prefilling[0]
            wants.append((head, head.computed + steps * max(1, budget)))
        elif kind == _FILL:
            left = budget
            for r in self.prefilling:
                if left <= 0:
                    break
                n = min(r.remaining, left)
                wants.append((r, r.computed + n))
                left -= n
        for r, tokens in sorted(wants, key=lambda w: w[0].seq):
            if not self._grow(r, tokens) and self.pool.pins:
                # agentkv demotes pins under pressure before vLLM has to preempt.
                self._demote_for(max(1, tokens // self.bt - r.alloc.blocks))  # type: ignore[union-attr]
            if not self._grow(r, tokens):
                running = self.prefilling + self.decoding
                self._preempt(max(running, key=lambda x: x.seq))
                return False
        return True
