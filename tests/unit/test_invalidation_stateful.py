"""The manager state machine (test_manager_stateful.ManagerMachine) with one more rule: the weights
change (or an external cache reset) mid-run, as the adapter does it: a new generation of keys
and ``invalidate_tiers`` in one critical section, while stores, requests, pins and timers are in
flight.

The simulated engine checks every load against ``key_of`` of the *current* generation, so a
load of any copy written before an invalidation is a violation; the index invariant accepts a
copy of any generation as true (old copies still being written are legitimately indexed until
their store reports). An upload is checked against the generation its key was derived in (the
manager's ``key_of`` records it): an upload queued before an invalidation (e.g. one that timed
out in the manager while the engine was idle, so it ships late) publishes an older generation's
key with that generation's KV, which is true (no later lookup derives that key), while a key the
manager never derived, or a copy that is not its key's KV in its generation, is a violation.
A restart (the base machine's rule) writes the manifest under the generation then; the new
process starts at the base generation (its weights are the files'), so a manifest written after
an invalidation restores nothing and its files are pruned.
Invalidations happen while no load or tier move is in flight (the RL contract: generation is
paused around a weight update; a reset answers unclean otherwise); stores and uploads may be.
All of ManagerMachine's invariants hold after every step, and everything drains to zero.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis.stateful import initialize, precondition, rule

import tests.unit.sim_engine as sim
import tests.unit.sim_workers as sim_workers
import tests.unit.stateful_invariants as invariants
import tests.unit.test_manager_stateful as base
from agentkv.kv_identity import BASE_GENERATION
from agentkv.manager.invalidation import invalidate_tiers

_ORIGINAL = sim.key_of
_BASE_SETUP = base.ManagerMachine.setup


class _Generations:
    """Generation 0 keys exactly as sim_engine.key_of; later ones are salted."""

    def __init__(self) -> None:
        self.all: list[bytes] = [b""]
        self.derived: dict[bytes, int] = {}  # every key the manager derived -> its generation

    def key(self, generation: bytes, h: bytes) -> bytes:
        return hashlib.blake2b(generation + b"fp" + h, digest_size=16).digest()

    def current(self, h: bytes) -> bytes:
        return self.key(self.all[-1], h)

    def derive(self, h: bytes) -> bytes:
        """The manager's key_of (the adapter's LogicalKeys.key_of): the current generation,
        remembered as the generation the key was derived (and its copies written) under."""
        key = self.current(h)
        self.derived[key] = len(self.all) - 1
        return key

    def written_under(self, key: bytes, content: bytes) -> bool:
        """``content`` is ``key``'s KV in the generation the manager derived ``key`` in."""
        g = self.derived.get(key)
        return g is not None and self.key(self.all[g], content) == key

    def any_generation(self, h: bytes) -> Any:
        gens = self

        class _AnyOf:
            def __eq__(self, key: object) -> bool:
                return any(gens.key(g, h) == key for g in gens.all)

            def __ne__(self, key: object) -> bool:
                return not self == key

        return _AnyOf()


class InvalidationMachine(base.ManagerMachine):
    def __init__(self) -> None:
        super().__init__()
        self.gens = _Generations()
        sim.key_of = self.gens.current  # loads and uploads: the current generation only
        sim_workers.key_of = self.gens.current
        base.key_of = self.gens.any_generation  # index invariant: true for its generation
        invariants.key_of = self.gens.any_generation

    @initialize(**_BASE_SETUP.hypothesis_stateful_initialize_rule.arguments)  # type: ignore[attr-defined]
    def setup(self, **kw: Any) -> None:
        _BASE_SETUP(self, **kw)
        self.workers.published_truth = self.gens.written_under

    def _configure(self, mgr: Any) -> None:
        """A new engine process loads the weights of its files: base generation (a restart
        after a weight update by the trainer reverts to the files' weights), keys as before."""
        if self.gens.all[-1] != b"":
            self.gens.all.append(b"")
        mgr.key_of = self.gens.derive  # the adapter's LogicalKeys.key_of

    def _generation(self) -> bytes:
        return BASE_GENERATION if self.gens.all[-1] == b"" else self.gens.all[-1]

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            sim.key_of = _ORIGINAL
            sim_workers.key_of = _ORIGINAL
            base.key_of = _ORIGINAL
            invariants.key_of = _ORIGINAL

    def _no_transfer_in_flight(self) -> bool:
        mgr = self.mgr
        if mgr is None or not self.quiet:
            return False
        # Stores and uploads may be in flight (their completion drops the copies an invalidation
        # left busy; an upload is checked against its keys' own generation).
        if any(job.kind not in ("store", "upload") for job in mgr.jobs.values()):
            return False
        if any(
            p.kind != "store" and not (p.kind == "move" and p.job.kind == "upload")
            for p in self.workers.pending
        ):
            return False  # timed out in the manager, still running on a (late) rank
        # A planned load (looked up, not allocated) is cancelled by the invalidation: clean
        # (issue 40 item 4); only a load copying keeps it unclean.
        return not any(req.load_state == "in_flight" for req in mgr.requests.values())

    @precondition(lambda self: self._no_transfer_in_flight())
    @rule()
    def weights_change(self) -> None:
        mgr = self.mgr
        assert mgr is not None
        with mgr.lock:
            self.gens.all.append(os.urandom(8))
            mgr.key_of = self.gens.derive
            result = invalidate_tiers(mgr, "weights")
        assert result.clean
        assert not mgr.table  # every trajectory ended
        named = {f"t{i}" for i in range(self.next_traj + 1)} | {t for t, _ in self.deleted_ids}
        for tid in named:
            for salt in base.SALTS:
                assert mgr.get(tid, tenant=salt)[0] == 404


InvalidationMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("AGENTKV_STATEFUL_EXAMPLES", "300")),
    stateful_step_count=int(os.environ.get("AGENTKV_STATEFUL_STEPS", "50")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestInvalidationStateful = InvalidationMachine.TestCase
