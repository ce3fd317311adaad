"""Restart recovery on the simulated engine and real block files: a trajectory offloaded to disk
is restored from the manifest into a fresh manager and its next turn loads the surviving files
with the right content; a manifest of another identity, generation or version, or a tampered
one, restores nothing; a restored tenant's trajectory prefetches in its namespace (issue 40 item
8); a DELETE's answer waits until no manifest lists the trajectory (item 10); a worker keeps
exactly its manager's keep plan, in its own DP rank's folder, and folders and manifests of ranks
that no longer run go (item 12)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from agentkv.kv_identity import BASE_GENERATION, new_generation
from agentkv.manager import BranchState
from agentkv.manager.jobs import KeepPlan, StepPlan
from agentkv.manager.recovery import (
    Manifest,
    ManifestKeeper,
    TrajectoryRecord,
    load_records,
    manifest_path,
    remove_stale_manifests,
    restore,
    snapshot,
)
from agentkv.manager.state import scoped_id
from agentkv.tiers.disk import TEMP_PREFIX, BlockFiles, rank_dir, remove_stale_rank_dirs
from agentkv.tiers.keys import BlockKey
from agentkv.tiers.store import TieredStore
from tests.unit.manager_helpers import counted
from tests.unit.sim_engine import Rig, make_rig

SYS = [7, 7, 7, 7, 9, 9, 9, 9]
P1 = [*SYS, 1, 2, 3, 4, 5, 6, 7, 8, 1]  # 4 full blocks
IDENTITY = bytes(range(16))


def _disk_offloaded() -> Rig:
    rig = make_rig(disk=32)
    rig.turn("t1", P1)
    code, body = rig.mgr.pause("t1", "main", "human", 400.0)
    assert code == 200 and body["decision"]["action"] == "offload_disk", body
    rig.settle()
    b = rig.mgr.table["t1"].branches["main"]
    assert b.state is BranchState.OFFLOADED and b.tier == "disk"
    return rig


def test_a_disk_offloaded_trajectory_resumes_after_a_restart(tmp_path: Path) -> None:
    before = _disk_offloaded()
    path = manifest_path(tmp_path)
    Manifest(IDENTITY, BASE_GENERATION, 4, tuple(snapshot(before.mgr))).write(path)

    after = make_rig(disk=32)  # a new process: empty manager, empty device pool
    after.workers.tiers[0].disk = dict(before.workers.tiers[0].disk)  # the files survive
    records = load_records(path, IDENTITY, BASE_GENERATION, 4)
    assert [(r.trajectory_id, len(r.keys)) for r in records] == [("t1", 4)]
    assert restore(after.mgr, records) == 1
    b = after.mgr.table["t1"].branches["main"]
    assert b.state is BranchState.OFFLOADED and b.tier == "disk" and b.token_ids == P1
    assert after.mgr.counters["trajectories_restored"] == 1
    nxt = after.turn("t1", [*P1, 4, 4, 4], steps=20)
    assert nxt.status == "FINISHED" and nxt.load_n == 4  # every block came from disk
    assert not after.eng.violations  # and held the right KV


def test_a_manifest_of_another_identity_or_generation_or_tampered_restores_nothing(
    tmp_path: Path,
) -> None:
    rig = _disk_offloaded()
    path = manifest_path(tmp_path, 1)
    Manifest(IDENTITY, BASE_GENERATION, 4, tuple(snapshot(rig.mgr))).write(path)
    assert load_records(path, IDENTITY, BASE_GENERATION, 4)
    assert load_records(path, bytes(16), BASE_GENERATION, 4) == []  # other model/weights/format
    assert load_records(path, IDENTITY, new_generation(), 4) == []  # after a reset or update
    assert load_records(path, IDENTITY, BASE_GENERATION, 8) == []  # other block size
    body = json.loads(path.read_text())
    body["trajectories"][0]["keys"][0] = "00" * 16
    path.write_text(json.dumps(body))
    assert load_records(path, IDENTITY, BASE_GENERATION, 4) == []
    path.write_bytes(path.read_bytes()[:50])  # torn
    assert load_records(path, IDENTITY, BASE_GENERATION, 4) == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left
    assert counted(rig) == {"store_blocks": 4, "stores": 1}


def test_the_keeper_rewrites_only_on_change_and_at_close(tmp_path: Path) -> None:
    rig = make_rig(disk=32)
    path = manifest_path(tmp_path)
    keeper = ManifestKeeper(rig.mgr, path, lambda: (IDENTITY, BASE_GENERATION), interval_s=3600)
    assert keeper.write_if_changed() and not keeper.write_if_changed()
    assert Manifest.read(path) is not None and Manifest.read(path).records == ()  # type: ignore[union-attr]
    rig.turn("t1", P1)
    rig.mgr.pause("t1", "main", "human", 400.0)
    rig.settle()
    assert keeper.write_if_changed()
    keeper.close()
    manifest = Manifest.read(path)
    assert manifest is not None and [r.trajectory_id for r in manifest.records] == ["t1"]
    assert counted(rig) == {"store_blocks": 4, "stores": 1}


def test_the_keeper_skips_what_the_manifest_does_not_hold(tmp_path: Path) -> None:
    """Turns, counters and host offloads change the manager, not the manifest: no rewrite (two
    fsyncs each); a disk copy of an offloaded branch and a new generation do (issue 26)."""
    rig = make_rig(disk=32)
    path = manifest_path(tmp_path)
    identity = [(IDENTITY, BASE_GENERATION)]
    keeper = ManifestKeeper(rig.mgr, path, lambda: identity[0], interval_s=3600)
    assert keeper.write_if_changed()
    rig.turn("t1", P1)
    code, body = rig.mgr.pause("t1", "main", "build", 2.0)
    assert code == 200 and body["decision"]["action"] == "offload_host"
    rig.settle()
    assert rig.mgr.counters and not keeper.write_if_changed()
    rig.turn("t2", [3, *P1[1:]])
    rig.mgr.pause("t2", "main", "human", 400.0)  # to disk
    rig.settle()
    assert keeper.write_if_changed() and not keeper.write_if_changed()
    identity[0] = (IDENTITY, new_generation())
    assert keeper.write_if_changed()
    assert keeper.writes == 3
    keeper.close()


def test_a_store_keeps_exactly_the_plan_of_its_own_identity(tmp_path: Path) -> None:
    """The worker's prune (TieredStore.prune_disk, from the manager's KeepPlan): listed files
    of this rank's identity stay and stay indexed; a listed name of another identity, an
    unlisted block, a torn file, a temp leftover and another block size's file go, from the
    folder and from the store's disk accounting."""
    block = 8192
    rank_fp, other_fp = b"\x01" * 16, b"\x02" * 16
    logical = [bytes([i]) * 16 for i in range(4)]

    def rank_key(k: bytes) -> BlockKey:
        return BlockKey(bytes(reversed(k[:15])) + b"\x09", rank_fp)

    folder = rank_dir(tmp_path, 0, 0)
    files = BlockFiles(folder, block, direct_io=False)
    payload = np.arange(block, dtype=np.uint8)
    keep_a = rank_key(logical[0])
    torn = rank_key(logical[1])
    foreign = BlockKey(rank_key(logical[2]).digest, other_fp)  # listed name, other identity
    unlisted = rank_key(logical[3])
    for key in (keep_a, torn, foreign, unlisted):
        files.write(key, [payload])
    BlockFiles(folder, block // 2, direct_io=False).write(rank_key(b"\x07" * 16), [payload[:4096]])
    with open(files.path_for(torn), "r+b") as handle:  # a crash cut this write short
        handle.truncate(os.path.getsize(files.path_for(torn)) // 2)
    (files.path_for(keep_a).parent / f"{TEMP_PREFIX}leftover").write_bytes(b"x" * 100)

    store = TieredStore(
        host_capacity_bytes=0,
        disk_dir=folder,
        disk_capacity_bytes=16 * files.file_bytes,
        block_bytes=block,
        direct_io=False,
    )
    try:
        plan = KeepPlan(frozenset(logical[:3]))
        kept, removed = store.prune_disk({rank_key(k) for k in plan.keys})
        assert kept == 1 and removed >= 3
        left = sorted(p.name for p in folder.rglob("*") if p.is_file())
        assert left == [files.path_for(keep_a).name]
        usage = store.stats().disk
        assert usage is not None and (usage.blocks, usage.used_bytes) == (1, files.file_bytes)
        assert store.tier_of(keep_a) == "disk" and store.tier_of(unlisted) is None
    finally:
        store.close()
    out = np.zeros(block, np.uint8)
    assert files.read_into(keep_a, [out]) and np.array_equal(out, payload)


def test_a_restore_exports_what_it_holds_on_disk_as_the_keep_plan() -> None:
    """The plan is what the manager indexed, not what the manifest listed: a smaller disk tier
    restores a prefix, and the workers keep exactly that prefix."""
    rig = _disk_offloaded()
    (rec,) = snapshot(rig.mgr)
    after = make_rig(disk=2)
    assert restore(after.mgr, [rec]) == 1
    plan = after.mgr.outbox.keep
    assert plan == KeepPlan(frozenset(rec.keys[:2]))
    step = after.mgr.take_step()
    assert step.keep == plan and after.mgr.take_step().keep is None  # the first step only
    assert StepPlan(keep=KeepPlan(frozenset())) and not StepPlan()  # never an empty step


def test_a_worker_applies_the_keep_plan_once_in_its_dp_folder(tmp_path: Path) -> None:
    """A real WorkerSide restarting: DP rank 1's folder is its own (DP rank 0's files are
    neither counted nor deleted); the first step's plan keeps the listed blocks, deletes the
    rest and reports what it lists but lacks; a later plan deletes nothing."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from agentkv.manager.jobs import BlockTransfer, StoreJob
    from agentkv.tier import Tier
    from agentkv_vllm.metadata import AgentKVStepMetadata
    from agentkv_vllm.settings import ConnectorSettings
    from agentkv_vllm.worker_side import WorkerSide

    def worker(dp_rank: int) -> WorkerSide:
        caches = {f"model.layers.{i}.attn": torch.ones(4, 2, 16, 8) * i for i in range(2)}
        w = WorkerSide(
            settings=ConnectorSettings(
                host_capacity_gib=0.01, disk_dir=str(tmp_path), run_dir=str(tmp_path)
            ),
            model_id="sim",
            tp_rank=0,
            tp_size=1,
            num_blocks=4,
            dp_rank=dp_rank,
            dp_size=2,
        )
        w.register_kv_caches(caches)
        return w

    def run(w: WorkerSide, **plan: object) -> None:
        w.start_step(AgentKVStepMetadata(StepPlan(**plan)))  # type: ignore[arg-type]
        for pending in w._jobs:
            pending.handle.result()
        w.poll()

    def disk_keys(w: WorkerSide, *logical: bytes) -> list[bytes]:
        assert w.store is not None
        return [k for k in logical if w.store.tier_of(w.rank_key(k)) == Tier.DISK]

    first = {rank: worker(rank) for rank in (0, 1)}
    for rank, w in first.items():
        blocks = [BlockTransfer(b"a", 0), BlockTransfer(b"b", 1), BlockTransfer(bytes([rank]), 2)]
        run(w, stores=[StoreJob(1, Tier.DISK, blocks, "t")])
        assert w.store is not None
        w.store.close()
    assert sorted(p.parents[2].name for p in tmp_path.rglob("*.kvb")) == ["dp0"] * 3 + ["dp1"] * 3

    again = worker(1)  # DP rank 1 restarts; its manager restored "a" and "z"
    assert disk_keys(again, b"a", b"b", b"\x00", b"\x01") == [b"a", b"b", b"\x01"]
    run(again, keep=KeepPlan(frozenset({b"a", b"z"})))
    assert disk_keys(again, b"a", b"b", b"\x01") == [b"a"]
    report = again.take_report()
    assert report is not None and report.report.bad_keys == {b"z": "miss"}
    run(again, stores=[StoreJob(2, Tier.DISK, [BlockTransfer(b"c", 3)], "t")])
    run(again, keep=KeepPlan(frozenset()))  # not a restart: ignored
    assert disk_keys(again, b"a", b"c") == [b"a", b"c"]
    assert again.store is not None
    again.store.close()
    dp0 = {p.name for p in rank_dir(tmp_path, 0, 0).rglob("*.kvb")}
    assert len(dp0) == 3  # DP rank 0's files: untouched by DP rank 1's restart


def test_folders_and_manifests_of_ranks_that_no_longer_run_go(tmp_path: Path) -> None:
    """Fewer DP (or TP) ranks than last run, or the layout before per-DP folders: DP rank 0
    removes the manifests nobody restores, each stale folder's one owner removes it; the
    folders of ranks that run and anything else under the root stay."""
    for dp in range(3):
        Manifest(IDENTITY, BASE_GENERATION, 4, ()).write(manifest_path(tmp_path, dp))
        for tp in range(2):
            (rank_dir(tmp_path, dp, tp) / "ab").mkdir(parents=True)
    (tmp_path / "rank0" / "ab").mkdir(parents=True)  # version 1's shared layout
    (tmp_path / "notes").mkdir()
    assert remove_stale_manifests(tmp_path, 2) == [manifest_path(tmp_path, 2)]
    # 3 DP ranks of 2 TP ranks -> now 2 DP ranks of 1 TP rank each
    assert remove_stale_rank_dirs(tmp_path, 1, 2, 1, 1) == 0  # only a DP rank's first worker
    assert remove_stale_rank_dirs(tmp_path, 1, 2, 0, 1) == 1  # dp1/rank1
    assert remove_stale_rank_dirs(tmp_path, 0, 2, 0, 1) == 3  # rank0, dp2, dp0/rank1
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_dir())
    assert left == ["dp0", "dp0/rank0", "dp0/rank0/ab", "dp1", "dp1/rank0", "dp1/rank0/ab", "notes"]
    assert sorted(p.name for p in tmp_path.glob("manifest-*")) == [
        "manifest-dp0.json",
        "manifest-dp1.json",
    ]


def test_a_restored_tenant_trajectory_prefetches_with_its_salt(tmp_path: Path) -> None:
    """Issue 40 item 8: the manifest keeps each trajectory's tenant; restored, a device
    prefetch's request carries the tenant's cache_salt (not an unsalted prefill of its
    context), loads the tenant's blocks and the unsalted namespace never sees the id."""
    salt = "tenant-a"
    before = make_rig(disk=32, device_prefetch=True)
    before.run(before.eng.new_request("t1", "main", P1, max_new=0, salt=salt))
    code, body = before.mgr.pause("t1", "main", "human", 400.0, tenant=salt)
    assert code == 200 and body["decision"]["action"] == "offload_disk"
    before.settle()
    path = manifest_path(tmp_path)
    Manifest(IDENTITY, BASE_GENERATION, 4, tuple(snapshot(before.mgr))).write(path)
    assert path.stat().st_mode & 0o777 == 0o600  # the salts stay the engine's

    after = make_rig(disk=32, device_prefetch=True)
    after.workers.tiers[0].disk = dict(before.workers.tiers[0].disk)
    assert restore(after.mgr, load_records(path, IDENTITY, BASE_GENERATION, 4)) == 1
    assert after.mgr.get("t1")[0] == 404 and after.mgr.get("t1", tenant=salt)[0] == 200
    traj = after.mgr.table[scoped_id("t1", salt)]
    branch = traj.branches["main"]
    code, _ = after.mgr.pause("t1", "main", "human", 400.0, tenant=salt)  # its next tool call
    assert code == 200 and branch.prefetch_due is not None
    after.clock.t = max(after.clock.t, branch.prefetch_due + 0.01)
    after.eng.step()
    (pre,) = after.eng.issue_prefetches()
    assert (pre.traj_id, pre.salt, pre.prompt) == ("t1", salt, P1)
    after.run(pre)
    assert branch.state is BranchState.RETAINED and not after.eng.violations
    assert after.mgr.counters["load_blocks"] == 4  # its blocks, from disk, in its namespace


def test_a_salted_trajectory_without_its_salt_orders_no_prefetch() -> None:
    """Defence in depth: a tenant's trajectory whose salt is unknown (kept only with device
    prefetch on, or a record without it) skips its prefetch instead of prefilling unsalted."""
    rig = make_rig(disk=32, device_prefetch=True)
    rig.run(rig.eng.new_request("t1", "main", P1, max_new=0, salt="tenant-a"))
    rig.mgr.pause("t1", "main", "human", 400.0, tenant="tenant-a")
    rig.settle()
    traj = rig.mgr.table[scoped_id("t1", "tenant-a")]
    traj.salt = None
    due = traj.branches["main"].prefetch_due
    assert due is not None
    rig.clock.t = due + 0.01
    rig.eng.step()
    assert rig.eng.issue_prefetches() == []
    assert rig.mgr.counters["device_prefetch_skipped_no_salt"] == 1


def test_old_manifests_and_records_of_another_tenant_restore_nothing(tmp_path: Path) -> None:
    """A version 1 manifest (no salts; its workers shared one folder across DP ranks) is
    ignored; a record whose salt names another tenant than its key is skipped."""
    rig = _disk_offloaded()
    path = manifest_path(tmp_path)
    Manifest(IDENTITY, BASE_GENERATION, 4, tuple(snapshot(rig.mgr))).write(path)
    body = json.loads(path.read_bytes())
    body.pop("checksum")
    body["version"] = 1
    for t in body["trajectories"]:
        t.pop("salt")
    from agentkv.manager.recovery import _checksum

    body["checksum"] = _checksum(body)
    path.write_text(json.dumps(body))
    assert Manifest.read(path) is None
    assert load_records(path, IDENTITY, BASE_GENERATION, 4) == []
    (rec,) = snapshot(rig.mgr)
    forged = TrajectoryRecord(
        scoped_id("t1", "a"), "main", rec.token_ids, rec.keys, rec.hashes, "b"
    )
    after = make_rig(disk=32)
    assert restore(after.mgr, [forged]) == 0 and not after.mgr.table


def test_a_delete_is_durable_before_its_answer(tmp_path: Path) -> None:
    """Issue 40 item 10: the keeper wrote a manifest listing t1; DELETE, then the control op's
    durable_delete: the manifest on disk no longer lists it before the answer, so a kill -9 now
    restores nothing of it. A DELETE of a trajectory no manifest lists writes nothing; a
    rewrite that fails removes the manifest rather than keep the deleted trajectory."""
    rig = _disk_offloaded()
    path = manifest_path(tmp_path)
    keeper = ManifestKeeper(rig.mgr, path, lambda: (IDENTITY, BASE_GENERATION), interval_s=3600)
    try:
        assert keeper.write_if_changed()
        assert [r.trajectory_id for r in Manifest.read(path).records] == ["t1"]  # type: ignore[union-attr]
        rig.turn("t2", [5] * 9)
        assert rig.mgr.delete("t2")[0] == 200
        keeper.durable_delete("t2")
        assert keeper.writes == 1  # t2 was in no manifest: no write
        assert rig.mgr.delete("t1")[0] == 200
        keeper.durable_delete("t1")
        assert keeper.writes == 2
        crashed = Manifest.read(path)  # what a restart after kill -9 reads
        assert crashed is not None and crashed.records == ()
        after = make_rig(disk=32)
        assert restore(after.mgr, load_records(path, IDENTITY, BASE_GENERATION, 4)) == 0

        rig.turn("t3", [3, *P1[1:]])
        rig.mgr.pause("t3", "main", "human", 400.0)
        rig.settle()
        assert keeper.write_if_changed()

        def refuse(self: Manifest, target: Path) -> None:
            raise OSError(28, "No space left on device")

        original = Manifest.write
        Manifest.write = refuse  # type: ignore[method-assign]
        try:
            assert rig.mgr.delete("t3")[0] == 200
            keeper.durable_delete("t3")
        finally:
            Manifest.write = original  # type: ignore[method-assign]
        assert not path.exists()  # no manifest rather than one that restores t3
    finally:
        keeper.close()


def test_the_keeper_writes_on_its_own_every_interval(tmp_path: Path) -> None:
    """Mutant recovery.ManifestKeeper._run__mutmut_2 (the thread waits for ``close`` only, so a
    crash loses everything since the start): the keeper's thread writes without being asked."""
    import threading

    wrote = threading.Event()

    class Signalling(ManifestKeeper):
        def write_if_changed(self) -> bool:
            changed = super().write_if_changed()
            wrote.set()
            return changed

    rig = make_rig(disk=32)
    path = manifest_path(tmp_path)
    keeper = Signalling(rig.mgr, path, lambda: (IDENTITY, BASE_GENERATION), interval_s=0.01)
    try:
        assert wrote.wait(timeout=10.0), "the keeper's thread never wrote the manifest"
        assert keeper.writes >= 1 and Manifest.read(path) is not None
    finally:
        keeper.close()
    assert counted(rig) == {}


def test_the_snapshot_lists_only_offloaded_disk_prefixes_and_restore_what_fits() -> None:
    rig = _disk_offloaded()  # t1: 4 blocks on disk
    rig.turn("t2", [5] * 16 + [1])
    rig.clock.advance(1.0)
    rig.settle()  # t2: offloaded to host only
    assert rig.mgr.table["t2"].branches["main"].state is BranchState.OFFLOADED
    rig.turn("t3", [*SYS, 6, 6, 6, 6, 1])  # held: its shared prefix is on disk, but it runs on
    t1 = rig.mgr.table["t1"].branches["main"]
    index = rig.mgr.index
    index.remove_copy(t1.keys[2], None)  # its third block lost: the first two are the prefix
    (rec,) = snapshot(rig.mgr)
    assert (rec.trajectory_id, rec.branch) == ("t1", "main")
    assert rec.keys == tuple(t1.keys[:2]) and rec.hashes == tuple(t1.hashes[:2])
    assert rec.token_ids == tuple(P1[:8])
    rig.mgr.delete("t1")
    assert snapshot(rig.mgr) == []

    after = make_rig(disk=3)  # a smaller disk tier than last run
    first = TrajectoryRecord("a", "main", tuple(P1[:8]), rec.keys, rec.hashes)
    again = TrajectoryRecord("a", "main", tuple(P1[:4]), rec.keys[:1], rec.hashes[:1])
    empty = TrajectoryRecord("e", "main", (), (), ())
    other = TrajectoryRecord("b", "main", tuple(range(8)), (b"x" * 16, b"y" * 16), (b"h", b"i"))
    assert restore(after.mgr, [first, again, empty, other]) == 2
    a = after.mgr.table["a"].branches["main"]
    assert a.keys == list(rec.keys) and a.token_ids == P1[:8]  # the first record wins
    b = after.mgr.table["b"].branches["main"]
    assert b.keys == [b"x" * 16]  # the prefix that fits: one slot was left
    assert b.token_ids == list(range(4)) and b.state is BranchState.OFFLOADED
    assert "e" not in after.mgr.table
    assert after.mgr.index.count("disk") == 3
    assert counted(after) == {"trajectories_restored": 2}


def test_the_manifest_checksum_is_blake2b_of_its_canonical_json(tmp_path: Path) -> None:
    """The file format: a manifest another build wrote must verify here (mutant
    recovery._checksum__mutmut_10, another separator in the canonical form, changed it)."""
    import hashlib

    path = manifest_path(tmp_path)
    Manifest(IDENTITY, BASE_GENERATION, 4, tuple(snapshot(_disk_offloaded().mgr))).write(path)
    body = json.loads(path.read_bytes())
    checksum = body.pop("checksum")
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    assert checksum == hashlib.blake2b(canonical, digest_size=16).hexdigest()


def test_a_dense_dp_rank_keeps_its_rank_and_the_deployment_size() -> None:
    """vLLM 0.32 runs each DP rank of a dense model as an independent engine and resets its
    data_parallel_rank/size to 0/1: the manifest and folders still name the real rank, and the
    stale-rank cleanup sees the real size (else DP rank 0 would delete the others' folders)."""
    pytest.importorskip("vllm")
    from vllm.config import ParallelConfig

    from agentkv_vllm.engine_config import dp_placement

    config = ParallelConfig(data_parallel_size=4, data_parallel_rank=2)
    assert dp_placement(config) == (2, 4)
    config.data_parallel_index = 2  # as EngineCoreProc.run_engine_core sets it
    config.reconfigure_for_independent_dp_rank()
    assert (config.data_parallel_rank, config.data_parallel_size) == (0, 1)
    assert dp_placement(config) == (2, 4)
    assert dp_placement(ParallelConfig()) == (0, 1)
