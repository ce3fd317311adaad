"""Device prefetch in the simulated replica: the manager's rule (``agentkv.prefetch_rule``) at
the same time (the pause's ``prefetch_at_s``), on the simulated pool and tiers.

Primitives:
  PrefetchMixin     the replica's device-prefetch operations:
    _arm_device_prefetch(tid, plan, blocks)   at ``plan.prefetch_at_s``: apply the rule; skip
                                              (a disk copy then still goes disk -> host), pin the
                                              context vLLM still caches, or load it from its tier
                                              into fresh blocks and pin it under the prefetch
                                              lease (``prefetch_lease_until``)
    _prefetch_on_submit(tid)                  the trajectory's next turn: ON_TIME or LATE
    _prefetch_on_demote(tid)                  a pinned prefetch given up unused: WASTED
  ``prefetch`` counts on_time / late / wasted and skips by reason (``skipped_<reason>``).

Kept apart from replica.py like the admission mixin; ``Replica`` is its only user.
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from typing import TYPE_CHECKING, Any

from agentkv.policy import PolicyParams
from agentkv.prefetch_rule import device_prefetch_skip, prefetch_lease_until

if TYPE_CHECKING:
    from agentkv.simulate.policies import PausePlan

_ARMED, _LOADING, _READY = "armed", "loading", "ready"


class PrefetchMixin:
    # The replica's (declared for the type checker; Replica sets them).
    env: Any
    pool: Any
    policy: Any
    host: Any
    disk: Any
    costs: Any
    waiting: Any
    returns_at: dict[str, float]
    lease_gen: dict[str, int]

    def _prefetch_init(self) -> None:
        self.prefetch: Counter[str] = Counter()
        self._pf_state: dict[str, str] = {}
        self._pf_gen: dict[str, int] = {}
        self._pf_prefix: dict[str, tuple[str, int]] = {}  # tid -> (group, shared prefix blocks)

    def _arm_device_prefetch(self, tid: str, plan: PausePlan, blocks: int) -> bool:
        """True when a device prefetch is armed for this pause (the caller then arms nothing
        else for it)."""
        gen = self._pf_gen.get(tid, 0) + 1
        self._pf_gen[tid] = gen
        if not getattr(self.policy, "device_prefetch", False) or plan.prefetch_at_s is None:
            return False
        self._pf_state[tid] = _ARMED
        paused = self.env.now
        self._at(plan.prefetch_at_s, partial(self._device_prefetch, tid, blocks, plan, gen, paused))
        return True

    def _device_prefetch(
        self, tid: str, blocks: int, plan: PausePlan, gen: int, paused: float
    ) -> None:
        if self._pf_gen.get(tid) != gen:
            return  # a turn came first (counted late) or the trajectory ended
        params: PolicyParams = getattr(self.policy, "params", PolicyParams())
        tier = self._copy_of(tid, blocks)
        cached = self._still_cached(tid, blocks)
        why = device_prefetch_skip(
            alive=tier is not None or cached,
            blocks=blocks,
            estimate=plan.estimate,
            max_spread=params.device_prefetch_max_spread,
            queue_blocked=bool(self.waiting),
            pool_usage=self.pool.usage(),
            total_blocks=self.pool.capacity,
            high_water=self.policy.high_water or 1.0,
        )
        if why is not None:
            self.prefetch[f"skipped_{why}"] += 1
            self._pf_state.pop(tid, None)
            if tier is self.disk:
                self._prefetch(tid, blocks)  # disk -> host, as without device prefetch
            return
        lease_until = prefetch_lease_until(
            self.env.now, paused, plan.estimate, params.device_prefetch_slack_s, params.max_lease_s
        )
        if cached:
            self.pool.pin(tid)  # vLLM still caches it: pinned again, nothing loaded
            self._prefetch_ready(tid, gen, blocks, lease_until, plan, loaded=False)
            return
        assert tier is not None
        self._pf_state[tid] = _LOADING
        done = tier.load(tid, blocks, self.env.now)
        if tier is self.disk and self.host is not None:
            done += blocks * tier.block_bytes / self.costs.host_link_bytes_per_s
        self._at(
            done - self.env.now,
            partial(self._prefetch_ready, tid, gen, blocks, lease_until, plan, True),
        )

    def _still_cached(self, tid: str, blocks: int) -> bool:
        """The whole context (its group's shared prefix, then its private blocks) is still in
        the pool's LRU."""
        group, prefix = self._pf_prefix.get(tid, ("", 0))
        if prefix and self.pool.prefix_cached.get(group, 0) < prefix:
            return False
        return bool(self.pool.lru.get(tid, 0) >= blocks - prefix)

    def _copy_of(self, tid: str, blocks: int) -> Any:
        for tier in (self.host, self.disk):
            if tier is not None and tier.blocks(tid) >= blocks:
                return tier
        return None

    def _prefetch_ready(
        self, tid: str, gen: int, blocks: int, until: float, plan: PausePlan, loaded: bool
    ) -> None:
        if self._pf_gen.get(tid) != gen:
            return
        group, prefix = self._pf_prefix.get(tid, ("", 0))
        if loaded and not self.pool.fill_pinned(tid, blocks - prefix, group, prefix):
            self.prefetch["skipped_headroom"] += 1
            self._pf_state.pop(tid, None)
            return
        self._pf_state[tid] = _READY
        self.returns_at[tid] = self.env.now + max(0.0, plan.predicted_wait_s)
        lease = self.lease_gen.get(tid, 0) + 1
        self.lease_gen[tid] = lease
        self._at(until - self.env.now, partial(self._lease_end, tid, lease))
        self._check_high_water()

    def _prefetch_on_submit(self, tid: str, group: str, prefix_blocks: int) -> str | None:
        self._pf_gen[tid] = self._pf_gen.get(tid, 0) + 1
        self._pf_prefix[tid] = (group, prefix_blocks)
        state = self._pf_state.pop(tid, None)
        if state is None:
            return None
        outcome = "on_time" if state == _READY and tid in self.pool.pins else "late"
        self.prefetch[outcome] += 1
        return outcome

    def _prefetch_on_demote(self, tid: str) -> None:
        if self._pf_state.get(tid) == _READY:
            del self._pf_state[tid]
            self.prefetch["wasted"] += 1

    def _prefetch_close(self, tid: str) -> None:
        self._pf_gen.pop(tid, None)
        self._pf_state.pop(tid, None)
        self._pf_prefix.pop(tid, None)

    # The replica's own operations this mixin calls.
    def _at(self, delay: float, fn: Any) -> None:
        raise NotImplementedError

    def _prefetch(self, tid: str, blocks: int) -> None:
        raise NotImplementedError

    def _lease_end(self, tid: str, gen: int) -> None:
        raise NotImplementedError

    def _check_high_water(self) -> None:
        raise NotImplementedError
