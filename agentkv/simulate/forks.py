"""Forks in the simulated replica: a fork's branches share the trajectory's history blocks.

Primitives:
  ForkMixin         the replica's fork bookkeeping:
    _fork_submit(req)       a fork's other branch (``Request.parent`` set) queued here
    _fork_admitted(req)     a trajectory's own request holds blocks now (``running``)
    _fork_finished(req)     it finished; a branch forgets its parent
    _forget_request(req)    it holds no blocks any more (finished or preempted)
    _fork_hits(parent, ...) a branch's hits: (prefix hit, blocks of the history it shares, no
                            tier, 0)

A fork turn sends one request per branch at once (agentkv.simulate.fleet); the first is the
trajectory's own and continues it, the others are requests of their own ids with ``parent``
set. vLLM's prefix cache shares full blocks by content: a branch's prompt starts with the
trajectory's history, so the blocks of it that are on the device, computed by the first branch
(running here: what it has computed so far) or still cached, are the branch's hit, and the
pool counts them once (``Allocation.borrowed``: used in place, neither taken nor freed by the
branch). Blocks the first branch has not computed yet are recomputed by each branch, as vLLM
does for requests scheduled in the same step. The branch's own blocks (its new tokens) are
cached under its id when it ends, where nothing will hit them again: they age out of the LRU
like vLLM's. Approximation: shared blocks still cached (the first branch done) are not held by
the branch, so the simulator could evict them under it. A fork never reaches a tier: its
branches are not paused (the harness joins the first).

Kept apart from replica.py like the other mixins; ``Replica`` is its only user.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentkv.simulate.replica import Request
    from agentkv.simulate.tiers import TierStore


class ForkMixin:
    # The replica's (declared for the type checker; Replica sets them).
    pool: Any
    bt: int

    def _fork_init(self) -> None:
        self.running: dict[str, Request] = {}
        """The admitted request of each trajectory (a fork's branches share its history)."""
        self.fork_parent: dict[str, str] = {}
        """A fork's other branches waiting or running here: branch id -> trajectory id."""

    def _fork_submit(self, req: Request) -> None:
        if req.parent is not None:
            self.fork_parent[req.tid] = req.parent

    def _fork_admitted(self, req: Request) -> None:
        if req.parent is None:
            self.running[req.tid] = req

    def _forget_request(self, req: Request) -> None:
        if req.parent is None and self.running.get(req.tid) is req:
            del self.running[req.tid]

    def _fork_finished(self, req: Request) -> None:
        self._forget_request(req)
        if req.parent is not None:
            self.fork_parent.pop(req.tid, None)

    def _fork_hits(
        self, parent: str, group: str, prefix_blocks: int, reusable: int
    ) -> tuple[int, int, TierStore | None, int]:
        """A branch of ``parent``'s fork: the shared prefix as any request, then the part of
        the trajectory's history on the device (``reusable`` blocks at most)."""
        pre, _ = self.pool.device_hit(parent, group, min(prefix_blocks, reusable), 0)
        if pre < min(prefix_blocks, reusable):
            return pre, 0, None, 0
        first = self.running.get(parent)
        if first is not None and first.alloc is not None:
            have = first.computed // self.bt - first.prefix_blocks
        else:
            have = self.pool.private.get(parent, 0)
        return pre, max(0, min(have, reusable - prefix_blocks)), None, 0
