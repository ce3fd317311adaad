"""Disk tier files: one checksummed file per block, written atomically, read with O_DIRECT.

Primitives:
    BlockFiles           a directory of block files of one size; thread-safe, no policy (the
                         store decides what to keep).
    BlockFiles.write     stage header+payload in an aligned buffer, write a temp file, rename into
                         place. ENOSPC/EDQUOT -> TierFullError; the temp file is removed, so no
                         partial block is ever visible under its final name.
    BlockFiles.read_into read, check header and checksum, then copy into the caller's segments.
                         Returns False when the file is absent; a truncated or corrupt file is
                         deleted and raises CorruptBlockError (the caller treats it as a miss).
    BlockFiles.uses_gds  whether device blocks move through GPUDirect Storage (see below).
    BlockFiles.remove    delete a block's file (absent is fine).
    BlockFiles.scan      rebuild the index after a restart from headers only, oldest first;
                         deletes temp leftovers and files with a broken header or size.
    BlockFiles.prune     keep only the blocks a predicate accepts, delete every other file
                         (temp leftovers, broken headers, other block sizes).
    rank_dir(disk_root, dp_rank, tp_rank)
                         the folder of one worker: ``<disk_root>/dp<d>/rank<t>``. Each DP rank's
                         workers have their own (DP engines never count or delete each other's
                         files); the DP rank's manager exports which files to keep after a
                         restart (``jobs.KeepPlan``, applied by ``TieredStore.prune_disk``).
    remove_stale_rank_dirs(disk_root, dp_rank, dp_size, tp_rank, tp_size)
                         a DP rank's first worker at start: the folders no engine of this
                         deployment uses any more (DP ranks >= dp_size, TP ranks >= tp_size,
                         the layout before per-DP folders) are deleted, each by one worker.

File format (little endian), header padded to HEADER_BYTES so the payload stays aligned:
    magic "AKVB" | version u16 | flags u16 | header_bytes u32 | payload_len u64 |
    payload xxh3_64 u64 | key digest 16B | fingerprint digest 16B | header xxh3_64 u64
followed by the payload, zero-padded to a multiple of ALIGN. No pickle, nothing executable.

O_DIRECT is probed once per directory; where the filesystem refuses it (tmpfs, some overlays)
the tier uses buffered I/O and logs that once. Files are not fsynced: the tier is a cache, and
the checksum turns a block torn by a crash into a miss.

Blocks in device memory (DeviceSegments, CUDA) take one of two paths, same files either way:
    staged (default)   copied with torch into this thread's staging buffer, which is pinned host
                       memory when CUDA is present, and written/read from there with O_DIRECT.
    GPUDirect Storage  when ``gds_available()`` (kvikio with cuFile usable) and not turned off:
                       the payload moves between a contiguous device buffer and the file through
                       cuFile; the header goes through ordinary I/O. The xxh3 checksum is computed
                       on a host copy of the payload (one device->host DMA), and a read is
                       verified before any byte reaches the caller's segments.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import shutil
import struct
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from agentkv.errors import CorruptBlockError, TierError, TierFullError
from agentkv.tiers import device
from agentkv.tiers.buffers import ByteArray, Segments, gather_into, scatter_from
from agentkv.tiers.device import DeviceSegments
from agentkv.tiers.host import HostBuffer, allocate_host
from agentkv.tiers.keys import KEY_BYTES, BlockKey

log = logging.getLogger(__name__)

MAGIC = b"AKVB"
VERSION = 1
ALIGN = 4096
HEADER_BYTES = ALIGN
SUFFIX = ".kvb"
TEMP_PREFIX = ".tmp-"
_HEADER = struct.Struct(f"<4sHHIQQ{KEY_BYTES}s{KEY_BYTES}s")
_HEADER_CHECKSUM = struct.Struct("<Q")
_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}

# Seam for tests: disk-full and short writes are injected by replacing this function.
_pwrite = os.pwrite


@dataclass(frozen=True, slots=True)
class DiskBlockInfo:
    """One valid-looking block file found by ``scan`` (payload not yet verified)."""

    key: BlockKey
    file_bytes: int
    mtime_ns: int


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def probe_direct_io(directory: Path) -> bool:
    """Return True when ``directory``'s filesystem accepts aligned O_DIRECT writes and reads."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    probe = directory / f"{TEMP_PREFIX}probe-{uuid.uuid4().hex}"
    buffer = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_RDWR | flag, 0o600)
        try:
            os.pwrite(fd, buffer, 0)
            os.preadv(fd, [buffer], 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        buffer.close()
        with contextlib.suppress(FileNotFoundError):
            probe.unlink()


class BlockFiles:
    """Block files of ``block_bytes`` payload each under ``directory``."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        block_bytes: int,
        *,
        direct_io: bool | None = None,
        pin_memory: bool | None = None,
        gds: bool | None = None,
    ) -> None:
        """Create ``directory`` (mode 0700) if needed and probe O_DIRECT unless ``direct_io`` is given.

        ``pin_memory`` is for the staging buffers (None: pinned when torch+CUDA are loaded).
        ``gds=None`` uses GPUDirect Storage for device blocks when it is available, True asks for
        it (a warning when unavailable), False never uses it.
        """
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.block_bytes = block_bytes
        self.file_bytes = HEADER_BYTES + _round_up(block_bytes, ALIGN)
        if direct_io is None:
            direct_io = probe_direct_io(self.directory)
            if not direct_io:
                log.warning(
                    "%s does not support O_DIRECT; the disk tier uses buffered I/O", self.directory
                )
        self.direct_io = direct_io
        self._open_flags = getattr(os, "O_DIRECT", 0) if direct_io else 0
        self._staging = threading.local()
        self._pin_memory = pin_memory
        self._gds_wanted = gds
        self._gds_io: Any = None
        self._gds_lock = threading.Lock()

    @property
    def uses_gds(self) -> bool:
        """True once a device block went (or would go) through GPUDirect Storage."""
        return self._gds_io is not None

    def _gds_for(self, segments: Segments) -> Any:
        """The DevicePayloadIO for a CUDA block when GDS is on, else None (staged path)."""
        if self._gds_wanted is False or not (
            isinstance(segments, DeviceSegments) and segments.is_cuda
        ):
            return None
        if self._gds_io is None:
            with self._gds_lock:
                if self._gds_io is None and self._gds_wanted is not False:
                    from agentkv.tiers import gds  # lazy: gds imports this module

                    if gds.gds_available():
                        self._gds_io = gds.DevicePayloadIO()
                        log.info(
                            "disk tier %s: device blocks use GPUDirect Storage", self.directory
                        )
                    else:
                        if self._gds_wanted:
                            log.warning(
                                "GPUDirect Storage requested but unavailable; staging through host"
                            )
                        self._gds_wanted = False
        return self._gds_io

    def path_for(self, key: BlockKey) -> Path:
        """Return where ``key``'s file lives (two hex characters of fan-out keep directories small)."""
        name = key.hex()
        return self.directory / name[:2] / f"{name}{SUFFIX}"

    def _staging_buffer(self) -> ByteArray:
        # One page-aligned buffer per worker thread: O_DIRECT needs aligned memory, and reusing
        # it avoids an allocation (and page faults) per block. Pinned when CUDA is present, so
        # device blocks are copied to and from it by DMA.
        buffer: HostBuffer | None = getattr(self._staging, "buffer", None)
        if buffer is None:
            buffer = allocate_host(self.file_bytes, self._pin_memory)
            self._staging.buffer = buffer
        return buffer.array

    def write(self, key: BlockKey, segments: Segments | Sequence[ByteArray]) -> int:
        """Write one block atomically; returns the bytes it occupies on disk.

        Blocks the calling thread (run it on a worker). Raises TierFullError when the disk is full
        and TierError on any other I/O failure; in both cases no file is left behind.
        """
        staging = self._staging_buffer()
        payload = staging[HEADER_BYTES : HEADER_BYTES + self.block_bytes]
        gds = self._gds_for(segments)  # type: ignore[arg-type]
        device_payload: Any = None
        if gds is not None:
            assert isinstance(segments, DeviceSegments)
            device_payload = device.gather_on_device(segments)
            device.copy_device_buffer_to_host(payload, device_payload)  # for the checksum
        else:
            gather_into(payload, segments)  # type: ignore[arg-type]
        header = _HEADER.pack(
            MAGIC,
            VERSION,
            0,
            HEADER_BYTES,
            self.block_bytes,
            xxhash.xxh3_64_intdigest(payload.data),
            key.digest,
            key.fingerprint_digest,
        )
        view = memoryview(staging)  # type: ignore[arg-type]
        view[: _HEADER.size] = header
        view[_HEADER.size : _HEADER.size + _HEADER_CHECKSUM.size] = _HEADER_CHECKSUM.pack(
            xxhash.xxh3_64_intdigest(header)
        )
        final = self.path_for(key)
        final.parent.mkdir(mode=0o700, exist_ok=True)
        temp = final.parent / f"{TEMP_PREFIX}{final.name}.{uuid.uuid4().hex}"
        try:
            fd = os.open(temp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | self._open_flags, 0o600)
            try:
                if gds is None:
                    self._pwrite_all(fd, view, self.file_bytes)
                else:  # header here, payload through cuFile; the padding reads as zeros
                    os.ftruncate(fd, self.file_bytes)
                    self._pwrite_all(fd, view, HEADER_BYTES)
            finally:
                os.close(fd)
            if gds is not None:
                gds.write_payload(temp, device_payload, self.block_bytes)
            os.replace(temp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                temp.unlink()
            if exc.errno in _FULL_ERRNOS:
                raise TierFullError(f"disk tier full writing {final.name}: {exc.strerror}") from exc
            raise TierError(f"disk tier write failed for {final.name}: {exc}") from exc
        except TierError:
            with contextlib.suppress(OSError):
                temp.unlink()
            raise
        finally:
            view.release()
        return self.file_bytes

    @staticmethod
    def _pwrite_all(fd: int, view: memoryview, length: int) -> None:
        written = 0
        while written < length:
            count = _pwrite(fd, view[written:length], written)
            if count <= 0:
                raise OSError(errno.EIO, "short write")
            written += count

    def read_into(self, key: BlockKey, segments: Segments | Sequence[ByteArray]) -> bool:
        """Fill ``segments`` with ``key``'s payload; returns False when no file exists.

        Blocks the calling thread. A truncated, mismatched or corrupt file is deleted and raises
        CorruptBlockError before any byte reaches ``segments``. Other I/O failures raise TierError.
        """
        path = self.path_for(key)
        staging = self._staging_buffer()
        gds = self._gds_for(segments)  # type: ignore[arg-type]
        wanted = HEADER_BYTES if gds is not None else self.file_bytes
        try:
            fd = os.open(path, os.O_RDONLY | self._open_flags)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise TierError(f"disk tier read failed for {path.name}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size < self.file_bytes:
                self._discard(path)
                raise CorruptBlockError(
                    f"{path.name} is truncated ({size} < {self.file_bytes} bytes)"
                )
            read = 0
            view = memoryview(staging)  # type: ignore[arg-type]
            try:
                while read < wanted:
                    count = os.preadv(fd, [view[read:wanted]], read)
                    if count <= 0:
                        break
                    read += count
            finally:
                view.release()
        except OSError as exc:
            raise TierError(f"disk tier read failed for {path.name}: {exc}") from exc
        finally:
            os.close(fd)
        if read < wanted:
            self._discard(path)
            raise CorruptBlockError(f"{path.name} is truncated")
        payload = staging[HEADER_BYTES : HEADER_BYTES + self.block_bytes]
        device_payload: Any = None
        if gds is not None:
            assert isinstance(segments, DeviceSegments)
            device_payload = device.device_buffer(segments)
            gds.read_payload(path, device_payload, self.block_bytes)
            device.copy_device_buffer_to_host(payload, device_payload)  # to verify the checksum
        problem = self._check(staging, key)
        if problem is not None:
            self._discard(path)
            raise CorruptBlockError(f"{path.name}: {problem}")
        if device_payload is not None:
            assert isinstance(segments, DeviceSegments)
            device.scatter_on_device(device_payload, segments)
        else:
            scatter_from(payload, segments)  # type: ignore[arg-type]
        return True

    def _check(self, staging: ByteArray, key: BlockKey) -> str | None:
        problem, header = self._parse_header(bytes(staging[:HEADER_BYTES]))
        if problem is not None or header is None:
            return problem
        _, _, _, _, _, checksum, digest, fingerprint = header
        if digest != key.digest or fingerprint != key.fingerprint_digest:
            return "header names another key"
        payload = staging[HEADER_BYTES : HEADER_BYTES + self.block_bytes]
        if xxhash.xxh3_64_intdigest(payload.data) != checksum:
            return "payload checksum mismatch"
        return None

    def _parse_header(
        self, raw: bytes
    ) -> tuple[str | None, tuple[bytes, int, int, int, int, int, bytes, bytes] | None]:
        if len(raw) < _HEADER.size + _HEADER_CHECKSUM.size:
            return "header truncated", None
        fields = _HEADER.unpack_from(raw)
        (stored,) = _HEADER_CHECKSUM.unpack_from(raw, _HEADER.size)
        if fields[0] != MAGIC:
            return "bad magic", None
        if fields[1] != VERSION:
            return f"unsupported version {fields[1]}", None
        if xxhash.xxh3_64_intdigest(raw[: _HEADER.size]) != stored:
            return "header checksum mismatch", None
        if fields[3] != HEADER_BYTES:
            return "unexpected header size", None
        return None, fields

    def _discard(self, path: Path) -> None:
        with contextlib.suppress(OSError):
            path.unlink()

    def remove(self, key: BlockKey) -> None:
        """Delete ``key``'s file; absent files are fine. Never raises for I/O errors (logs them)."""
        try:
            self.path_for(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not delete %s: %s", self.path_for(key), exc)

    def scan(self) -> list[DiskBlockInfo]:
        """Return the blocks present, oldest first, after deleting temp files and broken files.

        Reads headers only (the payload checksum is checked on every read). Files of another block
        size are left alone and not indexed: they belong to another configuration.
        """
        found: list[DiskBlockInfo] = []
        skipped_other_size = 0
        for subdir in self.directory.iterdir():
            if subdir.name.startswith(TEMP_PREFIX):
                self._discard(subdir)
                continue
            if not subdir.is_dir() or len(subdir.name) != 2:
                continue
            for path in subdir.iterdir():
                if path.name.startswith(TEMP_PREFIX):
                    self._discard(path)
                    continue
                if not path.name.endswith(SUFFIX):
                    continue
                info = self._scan_one(path)
                if info == "other-size":
                    skipped_other_size += 1
                elif isinstance(info, DiskBlockInfo):
                    found.append(info)
        if skipped_other_size:
            log.info(
                "%d block files of another block size left alone in %s",
                skipped_other_size,
                self.directory,
            )
        found.sort(key=lambda info: info.mtime_ns)
        return found

    def prune(self, keep: Callable[[DiskBlockInfo], bool]) -> tuple[int, int]:
        """After a restart: delete every file but the well-formed blocks ``keep`` accepts (temp
        leftovers of a write a crash cut short, broken headers, files of another block size,
        identity or generation); returns (kept, removed). Reads headers only: a torn payload is
        caught by the checksum of the load that reads it."""
        kept = removed = 0
        for subdir in list(self.directory.iterdir()):
            if subdir.name.startswith(TEMP_PREFIX):
                self._discard(subdir)
                removed += 1
                continue
            if not subdir.is_dir() or len(subdir.name) != 2:
                continue
            for path in list(subdir.iterdir()):
                info = None
                if path.name.endswith(SUFFIX) and not path.name.startswith(TEMP_PREFIX):
                    found = self._scan_one(path)  # deletes a broken file itself
                    info = found if isinstance(found, DiskBlockInfo) else None
                    if found is None:
                        removed += 1
                        continue
                if info is not None and keep(info):
                    kept += 1
                else:
                    self._discard(path)
                    removed += 1
        return kept, removed

    def _scan_one(self, path: Path) -> DiskBlockInfo | str | None:
        try:
            with path.open("rb") as handle:
                raw = handle.read(HEADER_BYTES)
                stat = os.fstat(handle.fileno())
        except OSError:
            return None
        problem, header = self._parse_header(raw)
        if problem is None and header is not None:
            payload_len, digest, fingerprint = header[4], header[6], header[7]
            if payload_len != self.block_bytes:
                return "other-size"
            if stat.st_size >= self.file_bytes and path.name == f"{digest.hex()}{SUFFIX}":
                return DiskBlockInfo(BlockKey(digest, fingerprint), stat.st_size, stat.st_mtime_ns)
        self._discard(path)
        return None


_DP_DIR = re.compile(r"dp(\d+)")
_RANK_DIR = re.compile(r"rank(\d+)")


def rank_dir(disk_root: str | os.PathLike[str], dp_rank: int, tp_rank: int) -> Path:
    """One worker's folder: DP ranks never share one (each counts and deletes only its own)."""
    return Path(disk_root) / f"dp{dp_rank}" / f"rank{tp_rank}"


def remove_stale_rank_dirs(
    disk_root: str | os.PathLike[str], dp_rank: int, dp_size: int, tp_rank: int, tp_size: int
) -> int:
    """Delete the worker folders under ``disk_root`` that no engine of this deployment uses now;
    returns how many. Only the first worker of a DP rank (TP rank 0) removes anything, before
    its own folder is opened: DP rank 0's removes every ``dp<k>`` with k >= dp_size and the
    layout before per-DP folders (``rank<t>``, shared by every DP rank; the version 1
    manifests that listed it are not restored); each DP rank's removes its ``dp<d>/rank<j>``
    with j >= tp_size. No folder in use is touched, nor the manifests or anything else in
    ``disk_root``."""
    if tp_rank != 0:
        return 0
    root = Path(disk_root)
    stale: list[Path] = []
    if dp_rank == 0:
        for entry in _listdir(root):
            legacy = _RANK_DIR.fullmatch(entry.name)
            match = _DP_DIR.fullmatch(entry.name)
            if legacy or (match and int(match.group(1)) >= dp_size):
                stale.append(entry)
    for entry in _listdir(root / f"dp{dp_rank}"):
        match = _RANK_DIR.fullmatch(entry.name)
        if match and int(match.group(1)) >= tp_size:
            stale.append(entry)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
        log.info("disk tier: removed %s (no engine of this deployment uses it)", path)
    return len(stale)


def _listdir(directory: Path) -> list[Path]:
    try:
        return [p for p in directory.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return []
