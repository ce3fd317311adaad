"""Restart recovery: trajectories offloaded to disk survive a clean stop and a crash.

Primitives:
    TrajectoryRecord     one branch whose context has complete disk copies: trajectory key (its
                         id scoped to its tenant), branch, its tenant's cache_salt, trusted
                         tokens, per block its logical tier key and engine hash
    snapshot(manager)    the records of every branch that is OFFLOADED with its leading blocks
                         on disk (the disk prefix only: host copies do not survive a restart)
    Manifest             identity digest, generation, block size, records; ``write`` is atomic
                         (temp file of mode 0600, fsync, rename, fsync of the directory) and
                         carries a checksum; ``read`` returns None for a missing, torn, foreign,
                         older-version or tampered file, never raises
    manifest_path(disk_root, dp_rank)
                         where a DP rank's manifest lives (``<disk_root>/manifest-dp<d>.json``;
                         its workers' files live in ``<disk_root>/dp<d>/rank<t>``, tiers.disk)
    remove_stale_manifests(disk_root, dp_size)
                         DP rank 0 at start: the manifests of DP ranks that no longer exist
                         (fewer DP ranks than last run) go; their workers' folders go with
                         them (``tiers.disk.remove_stale_rank_dirs``, worker side)
    restore(manager, records) -> int
                         recreate the branches as OFFLOADED on disk in their tenant's namespace
                         (the salt back on the trajectory, so a device prefetch's request hashes
                         its blocks as the turns did), each key indexed as a complete disk copy
                         the trajectory owns (up to the disk capacity); then export the keep
                         plan (``jobs.KeepPlan``: exactly the keys now indexed on disk) in the
                         first step's plan: each worker keeps those files and deletes the rest
    ManifestKeeper       a daemon thread that rewrites a manifest when its content changed
                         (checked every ``interval_s``), and once more at ``close``;
                         ``durable_delete``: a DELETE's answer waits until no manifest on disk
                         lists the trajectory (rewritten at once when the last one did)

What is trusted after a restart: a manifest is restored only when its format version, identity
digest and generation equal the engine's (a new model, other weights or KV format, a manifest
written after a cache reset or weight update, or by an agentkv before version 2, whose records
carry no tenant salt and whose workers shared one folder per TP rank across DP ranks, is
ignored); the manager never touches block files: its workers keep only the files of its keep
plan that carry their rank identity (``TieredStore.prune_disk``); a block file that is torn or
was never written is a checksum error or a miss at load time, which the engine recomputes. A
trajectory whose store was cut by a crash is not in the manifest: its next turn is recomputed.
A trajectory DELETE answered is in no manifest on disk: a crash right after it restores nothing
of it.

The manifest holds each salted trajectory's raw cache_salt (a device prefetch re-issues the
tenant's request with it); the file is the engine's own (mode 0600, next to the KV it keys),
never shown by a route.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentkv.manager.jobs import KeepPlan
from agentkv.manager.state import BranchState, DemotedBy, split_scoped, tenant_digest
from agentkv.tier import Tier

if TYPE_CHECKING:
    from agentkv.manager.core import TrajectoryManager

log = logging.getLogger("agentkv.recovery")

FORMAT = "agentkv-manifest"
# 2: records carry their tenant's salt, workers keep a folder per DP rank. A version 1 manifest
# is ignored (logged): its salted records could only come back without their salt.
VERSION = 2
MANIFEST_GLOB = "manifest-dp*.json"


@dataclass(frozen=True)
class TrajectoryRecord:
    trajectory_id: str  # the table key: the client's id scoped to its tenant (state.scoped_id)
    branch: str
    token_ids: tuple[int, ...]
    keys: tuple[bytes, ...]
    hashes: tuple[bytes, ...]
    salt: str | None = None  # the tenant's cache_salt (None: the unsalted namespace)

    def tenant_matches(self) -> bool:
        """Whether the salt names the namespace the key is scoped to. No salt: unknown (the
        manager keeps salts only with device prefetch on); the key still names the namespace,
        and a prefetch of a salted trajectory without its salt is never ordered."""
        if not self.salt:
            return True
        return split_scoped(self.trajectory_id)[1] == tenant_digest(self.salt)


def snapshot(manager: TrajectoryManager) -> list[TrajectoryRecord]:
    """Records of every OFFLOADED branch's leading blocks that have a complete disk copy."""
    bs = manager.config.block_size
    out = []
    with manager.lock:
        for traj in manager.table.values():
            if traj.deleted:
                continue
            for branch in traj.branches.values():
                if branch.state is not BranchState.OFFLOADED:
                    continue
                n = 0
                for key in branch.keys:
                    entry = manager.index.get(key)
                    if entry is None or entry.doomed or not entry.disk:
                        break
                    n += 1
                if n == 0:
                    continue
                tokens = branch.token_ids if n == len(branch.keys) else branch.token_ids[: n * bs]
                out.append(
                    TrajectoryRecord(
                        traj.trajectory_id,
                        branch.name,
                        tuple(tokens),
                        tuple(branch.keys[:n]),
                        tuple(branch.hashes[:n]),
                        traj.salt,
                    )
                )
    return out


def restore(manager: TrajectoryManager, records: Sequence[TrajectoryRecord]) -> int:
    """Recreate ``records`` as OFFLOADED branches on disk, each in its tenant's namespace with
    its salt; returns the branches restored. Exports the keep plan (what the manager now holds
    on disk) to the workers in the next step's plan."""
    restored = 0
    bs = manager.config.block_size
    index = manager.index
    with manager.lock:
        now = manager.clock.now()
        for rec in records:
            if not rec.keys or index.free(Tier.DISK) <= 0:
                continue
            if not rec.tenant_matches():
                log.warning("agentkv: a manifest record's salt names another tenant; skipped")
                continue
            traj = manager.names.for_request(rec.trajectory_id, now)
            if rec.salt:
                traj.salt = rec.salt  # a device prefetch's request must hash like the turns
            branch = traj.branch(rec.branch)
            if branch.keys:
                continue  # listed twice: the first record wins
            n = 0
            for key in rec.keys:
                entry = index.get(key)
                if entry is None or not entry.disk:
                    if index.free(Tier.DISK) <= 0:
                        break  # a smaller disk tier than last run: the prefix that fits
                    index.begin_write(key, Tier.DISK, traj.trajectory_id)
                    index.end_write(key, Tier.DISK, True)
                index.own(key, traj.trajectory_id)
                traj.owned.add(key)
                n += 1
            branch.token_ids = list(
                rec.token_ids if n == len(rec.keys) else rec.token_ids[: n * bs]
            )
            branch.keys = list(rec.keys[:n])
            branch.hashes = list(rec.hashes[:n])
            branch.block_ids = []
            branch.tier = Tier.DISK
            branch.demoted_by = DemotedBy.RESTART
            manager.transitions.set_state(traj, branch, BranchState.OFFLOADED)
            restored += 1
        manager.counters["trajectories_restored"] += restored
        # The manager never deletes block files: its workers keep exactly these (their first
        # step, before any other job) and delete every other file of their folders.
        manager.outbox.keep = KeepPlan(frozenset(index.keys_in(Tier.DISK)))
    return restored


def manifest_path(disk_root: str | os.PathLike[str], dp_rank: int = 0) -> Path:
    return Path(disk_root) / f"manifest-dp{dp_rank}.json"


def remove_stale_manifests(disk_root: str | os.PathLike[str], dp_size: int) -> list[Path]:
    """The manifests of DP ranks >= ``dp_size`` (a run with more DP ranks wrote them; no
    scheduler restores them now): deleted, so nothing counts their files any more. DP rank 0
    at start; returns what it removed."""
    removed = []
    for path in sorted(Path(disk_root).glob(MANIFEST_GLOB)):
        rank = path.name[len("manifest-dp") : -len(".json")]
        if rank.isdigit() and int(rank) >= dp_size:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
    return removed


@dataclass(frozen=True)
class Manifest:
    identity: bytes
    generation: bytes
    block_size: int
    records: tuple[TrajectoryRecord, ...]

    def _body(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "identity": self.identity.hex(),
            "generation": self.generation.hex(),
            "block_size": self.block_size,
            "trajectories": [
                {
                    "id": r.trajectory_id,
                    "branch": r.branch,
                    "tokens": list(r.token_ids),
                    "keys": [k.hex() for k in r.keys],
                    "hashes": [h.hex() for h in r.hashes],
                    "salt": r.salt,
                }
                for r in self.records
            ],
        }

    def write(self, path: Path) -> None:
        """Replace ``path`` atomically: a crash leaves the old manifest or the new one."""
        body = self._body()
        body["checksum"] = _checksum(body)
        data = json.dumps(body, separators=(",", ":")).encode()
        temp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        try:
            # 0600: the records carry tenants' salts
            fd = os.open(temp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
            with open(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()
        _fsync_dir(path.parent)

    @classmethod
    def read(cls, path: Path) -> Manifest | None:
        """The manifest at ``path``; None (logged) when absent, unreadable or inconsistent."""
        try:
            body = json.loads(path.read_bytes())
            checksum = body.pop("checksum")
            if body.get("format") != FORMAT:
                raise ValueError("not a manifest")
            if body.get("version") != VERSION:
                raise ValueError(f"manifest version {body.get('version')!r}, not {VERSION}")
            if checksum != _checksum(body):
                raise ValueError("checksum mismatch")
            records = tuple(
                TrajectoryRecord(
                    str(t["id"]),
                    str(t["branch"]),
                    tuple(int(x) for x in t["tokens"]),
                    tuple(bytes.fromhex(k) for k in t["keys"]),
                    tuple(bytes.fromhex(h) for h in t["hashes"]),
                    str(t["salt"]) if t.get("salt") else None,
                )
                for t in body["trajectories"]
            )
            return cls(
                bytes.fromhex(body["identity"]),
                bytes.fromhex(body["generation"]),
                int(body["block_size"]),
                records,
            )
        except FileNotFoundError:
            return None
        except Exception as exc:
            log.warning("agentkv: ignoring the manifest %s (%s)", path, exc)
            return None


def load_records(
    path: Path, identity: bytes, generation: bytes, block_size: int
) -> list[TrajectoryRecord]:
    """The records of the manifest at ``path`` when it was written by this identity,
    generation and block size; [] otherwise."""
    manifest = Manifest.read(path)
    if manifest is None:
        return []
    if (manifest.identity, manifest.generation, manifest.block_size) != (
        identity,
        generation,
        block_size,
    ):
        log.info("agentkv: manifest %s is of another identity or generation; not restored", path)
        return []
    return list(manifest.records)


def _checksum(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(canonical, digest_size=16).hexdigest()


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # a rename or unlink itself survives a power cut
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class ManifestKeeper:
    """Keeps ``path`` in step with the manager: a daemon thread takes the snapshot every
    ``interval_s`` and rewrites the manifest only when its content (records, identity,
    generation) differs from the last one written; ``close`` writes it once more (a clean stop
    loses nothing). The content, not a change counter: the snapshot is cheap, the write (two
    fsyncs) is not, and most of what a busy manager changes (counters, host copies, states of
    branches without disk copies) is not in the manifest.

    One write at a time (``_write_lock``, taken before the manager's lock, held across the
    snapshot and the write): a snapshot taken before a DELETE is never written after the
    DELETE's own rewrite."""

    def __init__(
        self,
        manager: TrajectoryManager,
        path: Path,
        identity: Callable[[], tuple[bytes, bytes]],
        *,
        interval_s: float = 1.0,
    ) -> None:
        self.manager = manager
        self.path = path
        self.identity = identity  # -> (identity digest, generation) now
        self.interval_s = interval_s
        self.writes = 0
        self._last: Manifest | None = None
        # Trajectory keys the manifest on disk may list (the last one written, or the one this
        # engine found at start, restored or not): a DELETE of another needs no rewrite.
        self._on_disk: frozenset[str] = frozenset()
        found = Manifest.read(path)
        if found is not None:
            self._on_disk = frozenset(r.trajectory_id for r in found.records)
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentkv-manifest", daemon=True)
        self._thread.start()

    def write_if_changed(self) -> bool:
        """Rewrite the manifest when its content changed since the last write."""
        with self._write_lock:
            return self._write_if_changed()

    def _write_if_changed(self) -> bool:
        with self.manager.lock:
            records = snapshot(self.manager)
            identity, generation = self.identity()
        manifest = Manifest(identity, generation, self.manager.config.block_size, tuple(records))
        if manifest == self._last:
            return False
        manifest.write(self.path)
        self._last = manifest
        self._on_disk = frozenset(r.trajectory_id for r in records)
        self.writes += 1
        return True

    def durable_delete(self, trajectory_key: str) -> None:
        """After the manager deleted ``trajectory_key`` (its table key) and before the DELETE
        answers: no manifest on disk lists it. The caller's thread (the control thread), not
        under the manager's lock but for the snapshot; a write in flight is waited for first
        (its snapshot may predate the DELETE). A failed rewrite removes the manifest instead (a
        restart then restores nothing, rather than a deleted trajectory); OSError when even
        that fails."""
        with self._write_lock:
            if trajectory_key not in self._on_disk:
                return
            try:
                self._write_if_changed()
            except Exception:
                log.exception("agentkv: rewriting the manifest %s after a DELETE failed", self.path)
                self._last = None
                self._on_disk = frozenset()
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                _fsync_dir(self.path.parent)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.write_if_changed()
            except Exception:  # a full or read-only disk must not stop the engine
                log.exception("agentkv: writing the manifest %s failed", self.path)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self._last = None
            self.write_if_changed()
        except Exception:
            log.exception("agentkv: writing the manifest %s at shutdown failed", self.path)
