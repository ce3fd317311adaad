"""The invariants of the manager's state machine (test_manager_stateful.py; its docstring lists
them by number), as a mixin: hypothesis collects ``@invariant`` methods from every base class.

Primitives:
    ManagerInvariants   the checks run after every step, on the machine's state (self.mgr,
                        self.eng, self.pool, self.workers and the bookkeeping of its rules).
    HOST, DISK, POOL    the tier capacities and the device pool (blocks) the machine is built with.
    SALTS, SALT_OF      the cache_salts the rules draw; tenant digest -> salt.
``key_of`` is read from this module at call time: a test that switches key generations patches
it here (test_invalidation_stateful.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis.stateful import invariant

from agentkv.manager import BranchState
from agentkv.manager.state import Branch, Trajectory, scoped_id, tenant_digest
from tests.unit.sim_engine import GARBAGE, key_of, pinned_content_breaches

HOST = 10
DISK = 10
POOL = 32
SALTS = [None, None, "tenant-b"]  # vLLM cache_salt: the same tokens, another tenant's blocks
SALT_OF = {None: None, **{tenant_digest(s): s for s in SALTS if s}}  # tenant digest -> salt


class ManagerInvariants:
    """The invariants; the machine's __init__ and setup build the state they read."""

    mgr: Any
    eng: Any
    pool: Any
    workers: Any
    tp: int
    cascades: list[Any]
    victims: list[Any]
    deleted: list[Any]
    deleted_ids: list[Any]
    announced: dict[str, set[bytes]]
    jobs_at_delete: dict[int, Any]
    looked_up_before_delete: Any

    @invariant()
    def sim_saw_nothing_wrong(self) -> None:
        if self.mgr is None:
            return
        assert not self.eng.violations, self.eng.violations
        assert not self.cascades, self.cascades

    @invariant()
    def deferred_write_backs_track_cached_branches(self) -> None:
        """8. every branch with a recorded eviction due is CACHED (a resume, a copy or a
        delete takes it off), and each live heap entry carries exactly that due (a resume's
        shift of the contexts ahead of it moves both)."""
        if self.mgr is None:
            return
        wb = self.mgr.writebacks
        cached = {ref: b for ref, (_, b) in wb.cached.items()}
        for ref in wb.due:
            assert ref in cached and cached[ref].state.value == "cached", ref
        for entry in wb.heap:
            live = wb.live(entry)
            if live is not None:
                assert wb.due.get((id(live[0]), live[1].name)) == entry[0], entry

    @invariant()
    def deleted_branches_hold_no_write_back(self) -> None:
        """8c. (issue 40 item 11) a deleted or ended trajectory is referenced by no write-back
        structure, under every write-back mode: not CACHED-tracked, no due, no place in the free
        queue, and no heap entry holds it or its branches (a stale entry names its branch by id
        only, so the trajectory's memory goes at the DELETE) or is live for it."""
        if self.mgr is None:
            return
        wb = self.mgr.writebacks
        live_ids = {id(t) for t in self.mgr.table.values()}
        for ref, (traj, _) in wb.cached.items():
            assert not traj.deleted and ref[0] in live_ids, ref
        for ref in list(wb.due) + list(wb.placed.places):
            assert ref[0] in live_ids, ref
        live_branches = {id(b) for t in self.mgr.table.values() for b in t.branches.values()}
        for entry in wb.heap:
            for part in entry:
                assert not isinstance(part, Trajectory) or not part.deleted, entry
                assert not isinstance(part, Branch) or id(part) in live_branches, entry
            live = wb.live(entry)
            if live is not None:
                assert id(live[0]) in live_ids, entry

    @invariant()
    def placed_branches_sit_unpinned_in_the_free_queue(self) -> None:
        """8b. every branch placed in vLLM's free queue belongs to a live trajectory, is paused
        without pins of its own (CACHED, OFFLOADED, DROPPED, or a host copy moving to disk),
        and a CACHED one sits at its due. A pin (a grace, a lease, a deferred copy's store job)
        or a resume takes it off; a branch left placed would stand ahead of the others."""
        if self.mgr is None:
            return
        wb = self.mgr.writebacks
        live = {
            (id(t), name): b
            for t in self.mgr.table.values()
            if not t.deleted
            for name, b in t.branches.items()
        }
        for ref, (at, _) in wb.placed.places.items():
            branch = live.get(ref)
            assert branch is not None, ref
            state = branch.state.value
            assert state in ("cached", "offloaded", "dropped", "offloading"), (ref, state)
            if branch.device_prefetch is None:
                assert branch.pinned == [], (ref, state)
            if state == "cached" and ref in wb.due:
                assert wb.due[ref] == at, (ref, wb.due[ref], at)

    @invariant()
    def device_prefetch_states_are_consistent(self) -> None:
        """A prefetch being ordered or loaded belongs to an OFFLOADED, idle branch of a live
        trajectory; a ready one pins only as RETAINED (else it fell back, pinning nothing); no
        order waits for a deleted trajectory."""
        if self.mgr is None:
            return
        from agentkv.manager.prefetch import PrefetchState

        for traj in self.mgr.table.values():
            for name, b in traj.branches.items():
                dp = b.device_prefetch
                if dp is None:
                    continue
                where = f"{traj.trajectory_id}/{name} {dp.state} in {b.state}"
                if dp.state is PrefetchState.READY:
                    assert b.state is BranchState.RETAINED or not b.pinned, where
                else:
                    assert b.state is BranchState.OFFLOADED and not b.running, where
        for traj, _, _ in self.mgr.prefetcher.orders:
            assert not traj.deleted, traj.trajectory_id

    @invariant()
    def pressure_victims_are_demoted(self) -> None:
        """Each branch pressure_victims picked left RETAINED (its pins went to a store job or
        back to vLLM), unless a newer pause decided again since."""
        for branch, decision in self.victims:
            if branch.decision is decision:
                assert branch.state is not BranchState.RETAINED, branch.summary()
        self.victims = []

    @invariant()
    def pinned_blocks_hold_their_keys_kv(self) -> None:
        """Every device block the manager pins (for a branch or a store job) holds its keys'
        true KV on every rank: a wrong pin would serve or store another context's KV."""
        mgr = self.mgr
        if mgr is None:
            return
        trajs = list(mgr.table.values()) + list(mgr.tombstones.values()) + self.deleted
        breaches = pinned_content_breaches(mgr, self.pool, trajs, key_of)
        assert not breaches, breaches

    @invariant()
    def change_log_replays_to_the_index(self) -> None:
        """The KV events' source: replaying (key, tier, present) in order gives exactly the
        copies the index holds (a router never believes in a copy that is gone)."""
        mgr = self.mgr
        if mgr is None:
            return
        for key, tier, present in mgr.take_tier_changes():
            if present:
                assert key not in self.announced[tier], f"{tier} gained {key.hex()[:8]} twice"
                self.announced[tier].add(key)
            else:
                assert key in self.announced[tier], f"{tier} lost {key.hex()[:8]} never gained"
                self.announced[tier].discard(key)
        for tier in ("host", "disk"):
            assert self.announced[tier] == set(mgr.tier_keys(tier)), tier  # type: ignore[arg-type]

    @invariant()
    def pins_balance(self) -> None:
        mgr = self.mgr
        if mgr is None:
            return
        in_pool = Counter({b: n for b, n in enumerate(self.pool.pins) if n})
        assert in_pool == +mgr._pins, (in_pool, mgr._pins)
        expected: Counter[int] = Counter()
        trajs = list(mgr.table.values()) + list(mgr.tombstones.values()) + self.deleted
        seen: set[int] = set()
        for traj in trajs:
            if id(traj) in seen:
                continue
            seen.add(id(traj))
            for b in traj.branches.values():
                expected.update(b.pinned)
        for job in mgr.jobs.values():
            if job.kind == "store":
                expected.update(job.block_ids)
        for op, arg in mgr._pin_ops:
            if op == "unpin":
                expected.update(arg)
        assert +expected == +mgr._pins, (expected, mgr._pins)

    @invariant()
    def tenants_never_cross(self) -> None:
        """A trajectory's requests and context are its tenant's only: every running request
        belongs to the trajectory of its (id, cache_salt); every branch's keys are its tokens'
        keys under its tenant's salt (another tenant's turn never became its context)."""
        mgr = self.mgr
        if mgr is None:
            return
        for rid, req in mgr.requests.items():
            sim = self.eng.requests.get(rid)
            if sim is not None:
                assert req.traj.trajectory_id == scoped_id(sim.traj_id, sim.salt), rid
        for traj in mgr.table.values():
            salt = SALT_OF[traj.tenant]
            for b in traj.branches.values():
                if b.keys:
                    want = [key_of(h) for h in self.eng.hashes(b.token_ids, salt)]
                    assert b.keys == want[: len(b.keys)], (traj.trajectory_id, b.name)

    @invariant()
    def salt_generations_index_the_table(self) -> None:
        """salt_generations: the id -> table keys index (what a turn under a new salt looks
        its old salts up in) lists exactly the table's keys, per id; off, there is none."""
        mgr = self.mgr
        if mgr is None:
            return
        if not mgr.config.salt_generations:
            assert mgr.names.by_name is None
            return
        want: dict[str, set[str]] = {}
        for key, traj in mgr.table.items():
            want.setdefault(traj.name, set()).add(key)
        assert mgr.names.by_name == want

    @invariant()
    def ownership(self) -> None:
        mgr = self.mgr
        if mgr is None:
            return
        for traj in self.deleted:
            assert traj.deleted and not traj.owned
            assert all(not b.pinned for b in traj.branches.values())
        for j, job in mgr.jobs.items():  # a deleted trajectory's requests store nothing new
            if job.trajectory is not None and id(job.trajectory) in self.jobs_at_delete:
                assert j in self.jobs_at_delete[id(job.trajectory)], job
        for traj in mgr.tombstones.values():
            assert traj.deleted and traj.running > 0
        for rid in self.looked_up_before_delete:  # DELETE is final against waiting requests
            req = mgr.requests.get(rid)
            assert req is None or req.traj.deleted, f"{rid} re-created {req.traj.trajectory_id}"
            assert rid not in mgr.reqs._waiting
        for tid, salt in self.deleted_ids:
            if scoped_id(tid, salt) not in mgr.table:
                assert mgr.get(tid, tenant=salt)[0] == 404
        for key in mgr.index:
            e = mgr.index.get(key)
            assert e is not None
            if not e.owners:
                assert e.doomed, f"unowned key {key.hex()[:8]} neither doomed nor dropped"
            for owner in e.owners:
                live = mgr.table.get(owner)
                assert live is not None, f"key {key.hex()[:8]} owned by gone trajectory {owner}"
                assert key in live.owned, f"{owner} owns {key.hex()[:8]} without knowing it"

    @invariant()
    def index_equals_stores(self) -> None:
        mgr = self.mgr
        if mgr is None:
            return
        pending_drops: dict[str, set[bytes]] = {"host": set(), "disk": set()}
        for keys, tier, _ in mgr._timed_out.values():  # a late rank may still publish these:
            pending_drops[tier].update(keys)  # dropped when its report arrives
        for drop in mgr._outbox.drops:
            for tier in ("host", "disk") if drop.tier is None else (drop.tier,):
                pending_drops[tier].update(drop.keys)
        for rank in range(self.tp):
            for tier in ("host", "disk"):
                store = self.workers.tiers[rank][tier]
                assert len(store) <= (HOST if tier == "host" else DISK)
                for key, content in store.items():
                    e = mgr.index.get(key)
                    known = e is not None and (e.has(tier) or tier in e.writing)  # type: ignore[arg-type]
                    if not known:
                        assert key in pending_drops[tier], (
                            f"rank {rank} {tier} holds {key.hex()[:8]} the index does not know"
                        )
                        continue
                    if e is not None and e.has(tier):  # type: ignore[arg-type]
                        assert content != GARBAGE and content is not None
                        assert key_of(content) == key, f"{tier} copy of {key.hex()[:8]} is wrong"
        # A rank that found its copy damaged deleted it (as the real store deletes the file);
        # the index forgets it when that rank's report (the key: corrupt) arrives.
        reported_bad = {k for rep in self.workers.reports for k in rep.bad_keys}
        for key in mgr.index:
            e = mgr.index.get(key)
            assert e is not None
            if key in reported_bad:
                continue
            for tier in ("host", "disk"):
                if e.has(tier) and tier not in e.writing:  # type: ignore[arg-type]
                    for rank in range(self.tp):
                        assert key in self.workers.tiers[rank][tier], (
                            f"index lists {key.hex()[:8]} in {tier}, rank {rank} lacks it"
                        )
