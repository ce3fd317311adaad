"""Restart recovery: trajectories offloaded to disk survive a clean stop and a crash.

Primitives:
    TrajectoryRecord     one branch whose context has complete disk copies: trajectory id,
                         branch, trusted tokens, per block its logical tier key and engine hash
    snapshot(manager)    the records of every branch that is OFFLOADED with its leading blocks
                         on disk (the disk prefix only: host copies do not survive a restart)
    Manifest             identity digest, generation, block size, records; ``write`` is atomic
                         (temp file, fsync, rename, fsync of the directory) and carries a
                         checksum; ``read`` returns None for a missing, torn, foreign or
                         tampered file, never raises
    manifest_path(disk_root, dp_rank), manifest_keys(disk_root, generation)
                         where a DP rank's manifest lives; the logical keys every manifest of a
                         disk root lists under ``generation`` (the workers keep those files)
    restore(manager, records) -> int
                         recreate the branches as OFFLOADED on disk, each key indexed as a
                         complete disk copy the trajectory owns (up to the disk capacity)
    ManifestKeeper       a daemon thread that rewrites a manifest when its content changed
                         (checked every ``interval_s``), and once more at ``close``
    prune_rank_files(disk_root, rank_dir, block_bytes, rank_key, fingerprint)
                         a worker at start: keep the block files the manifests list (as this
                         rank names them) under this rank's identity, delete the rest

What is trusted after a restart: a manifest is restored only when its identity digest and its
generation equal the engine's (a new model, other weights or KV format, or a manifest written
after a cache reset or weight update is ignored); the workers keep only block files whose
header names their rank identity and whose key a manifest lists (disk.BlockFiles.prune); a
block file that is torn or was never written is a checksum error or a miss at load time, which
the engine recomputes. A trajectory whose store was cut by a crash is not in the manifest: its
next turn is recomputed.
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

from agentkv.kv_identity import BASE_GENERATION
from agentkv.manager.state import BranchState, DemotedBy
from agentkv.tier import Tier
from agentkv.tiers.disk import BlockFiles
from agentkv.tiers.keys import BlockKey

if TYPE_CHECKING:
    from agentkv.manager.core import TrajectoryManager

log = logging.getLogger("agentkv.recovery")

FORMAT = "agentkv-manifest"
VERSION = 1


@dataclass(frozen=True)
class TrajectoryRecord:
    trajectory_id: str
    branch: str
    token_ids: tuple[int, ...]
    keys: tuple[bytes, ...]
    hashes: tuple[bytes, ...]


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
                    )
                )
    return out


def restore(manager: TrajectoryManager, records: Sequence[TrajectoryRecord]) -> int:
    """Recreate ``records`` as OFFLOADED branches on disk; returns the branches restored."""
    restored = 0
    bs = manager.config.block_size
    index = manager.index
    with manager.lock:
        now = manager.clock.now()
        for rec in records:
            if not rec.keys or index.free(Tier.DISK) <= 0:
                continue
            traj = manager.names.for_request(rec.trajectory_id, now)
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
    return restored


def manifest_path(disk_root: str | os.PathLike[str], dp_rank: int = 0) -> Path:
    return Path(disk_root) / f"manifest-dp{dp_rank}.json"


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
                }
                for r in self.records
            ],
        }

    def write(self, path: Path) -> None:
        """Replace ``path`` atomically: a crash leaves the old manifest or the new one."""
        body = self._body()
        body["checksum"] = _checksum(body)
        data = json.dumps(body, separators=(",", ":")).encode()
        temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(temp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()
        with contextlib.suppress(OSError):  # the rename itself survives a power cut
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    @classmethod
    def read(cls, path: Path) -> Manifest | None:
        """The manifest at ``path``; None (logged) when absent, unreadable or inconsistent."""
        try:
            body = json.loads(path.read_bytes())
            checksum = body.pop("checksum")
            if body.get("format") != FORMAT or body.get("version") != VERSION:
                raise ValueError("not a manifest of this version")
            if checksum != _checksum(body):
                raise ValueError("checksum mismatch")
            records = tuple(
                TrajectoryRecord(
                    str(t["id"]),
                    str(t["branch"]),
                    tuple(int(x) for x in t["tokens"]),
                    tuple(bytes.fromhex(k) for k in t["keys"]),
                    tuple(bytes.fromhex(h) for h in t["hashes"]),
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


def manifest_keys(disk_root: str | os.PathLike[str], generation: bytes) -> set[bytes]:
    """Logical keys listed by every manifest under ``disk_root`` written in ``generation``."""
    keys: set[bytes] = set()
    root = Path(disk_root)
    if not root.is_dir():
        return keys
    for path in sorted(root.glob("manifest-dp*.json")):
        manifest = Manifest.read(path)
        if manifest is not None and manifest.generation == generation:
            for rec in manifest.records:
                keys.update(rec.keys)
    return keys


def _checksum(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(canonical, digest_size=16).hexdigest()


class ManifestKeeper:
    """Keeps ``path`` in step with the manager: a daemon thread takes the snapshot every
    ``interval_s`` and rewrites the manifest only when its content (records, identity,
    generation) differs from the last one written; ``close`` writes it once more (a clean stop
    loses nothing). The content, not a change counter: the snapshot is cheap, the write (two
    fsyncs) is not, and most of what a busy manager changes (counters, host copies, states of
    branches without disk copies) is not in the manifest."""

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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentkv-manifest", daemon=True)
        self._thread.start()

    def write_if_changed(self) -> bool:
        """Rewrite the manifest when its content changed since the last write."""
        with self.manager.lock:
            records = snapshot(self.manager)
            identity, generation = self.identity()
        manifest = Manifest(identity, generation, self.manager.config.block_size, tuple(records))
        if manifest == self._last:
            return False
        manifest.write(self.path)
        self._last = manifest
        self.writes += 1
        return True

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


def prune_rank_files(
    disk_root: str | os.PathLike[str],
    rank_dir: Path,
    block_bytes: int,
    rank_key: Callable[[bytes], BlockKey],
    fingerprint: bytes,
) -> tuple[int, int]:
    """A worker at start: keep the block files whose header names this rank's identity
    (``fingerprint``) and whose key a base-generation manifest lists; returns (kept, removed)."""
    keep = {rank_key(k).digest for k in manifest_keys(disk_root, BASE_GENERATION)}
    files = BlockFiles(rank_dir, block_bytes, direct_io=False)
    return files.prune(
        lambda info: info.key.fingerprint_digest == fingerprint and info.key.digest in keep
    )
