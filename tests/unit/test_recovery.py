"""Restart recovery on the simulated engine and real block files: a trajectory offloaded to disk
is restored from the manifest into a fresh manager and its next turn loads the surviving files
with the right content; a manifest of another identity or generation, or a tampered one, restores
nothing; a worker keeps only the files its manifest lists under its own rank identity, and
nothing torn by a crash is kept."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from agentkv.kv_identity import BASE_GENERATION, new_generation
from agentkv.manager import BranchState
from agentkv.manager.recovery import (
    Manifest,
    ManifestKeeper,
    TrajectoryRecord,
    load_records,
    manifest_path,
    prune_rank_files,
    restore,
    snapshot,
)
from agentkv.tiers.disk import TEMP_PREFIX, BlockFiles
from agentkv.tiers.keys import BlockKey
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


def test_a_worker_keeps_only_listed_files_of_its_own_identity(tmp_path: Path) -> None:
    block = 8192
    rank_fp, other_fp = b"\x01" * 16, b"\x02" * 16
    logical = [bytes([i]) * 16 for i in range(4)]

    def rank_key(k: bytes) -> BlockKey:
        return BlockKey(bytes(reversed(k[:15])) + b"\x09", rank_fp)

    listed = [
        TrajectoryRecord("t", "main", tuple(range(12)), tuple(logical[:3]), (b"h",) * 3),
    ]
    Manifest(IDENTITY, BASE_GENERATION, 4, tuple(listed)).write(manifest_path(tmp_path))
    stale = Manifest(
        IDENTITY, new_generation(), 4, (TrajectoryRecord("u", "main", (), (logical[3],), (b"h",)),)
    )
    stale.write(manifest_path(tmp_path, 1))  # written after a reset: not trusted
    rank_dir = tmp_path / "rank0"
    files = BlockFiles(rank_dir, block, direct_io=False)
    payload = np.arange(block, dtype=np.uint8)
    keep_a = rank_key(logical[0])
    torn = rank_key(logical[1])
    foreign = BlockKey(rank_key(logical[2]).digest, other_fp)  # listed name, other identity
    unlisted = rank_key(logical[3])
    for key in (keep_a, torn, foreign, unlisted):
        files.write(key, [payload])
    with open(files.path_for(torn), "r+b") as handle:  # a crash cut this write short
        handle.truncate(os.path.getsize(files.path_for(torn)) // 2)
    (files.path_for(keep_a).parent / f"{TEMP_PREFIX}leftover").write_bytes(b"x" * 100)

    kept, removed = prune_rank_files(tmp_path, rank_dir, block, rank_key, rank_fp)
    assert (kept, removed) == (1, 4)
    left = sorted(p.name for p in rank_dir.rglob("*") if p.is_file())
    assert left == [files.path_for(keep_a).name]
    out = np.zeros(block, np.uint8)
    assert files.read_into(keep_a, [out]) and np.array_equal(out, payload)


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
