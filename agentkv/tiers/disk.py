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
    BlockFiles.remove    delete a block's file (absent is fine).
    BlockFiles.scan      rebuild the index after a restart from headers only, oldest first;
                         deletes temp leftovers and files with a broken header or size.

File format (little endian), header padded to HEADER_BYTES so the payload stays aligned:
    magic "AKVB" | version u16 | flags u16 | header_bytes u32 | payload_len u64 |
    payload xxh3_64 u64 | key digest 16B | fingerprint digest 16B | header xxh3_64 u64
followed by the payload, zero-padded to a multiple of ALIGN. No pickle, nothing executable.

O_DIRECT is probed once per directory; where the filesystem refuses it (tmpfs, some overlays)
the tier uses buffered I/O and logs that once. Files are not fsynced: the tier is a cache, and
the checksum turns a block torn by a crash into a miss.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import struct
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from agentkv.errors import CorruptBlockError, TierError, TierFullError
from agentkv.tiers.buffers import ByteArray, gather_into, scatter_from
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
        self, directory: str | os.PathLike[str], block_bytes: int, *, direct_io: bool | None = None
    ) -> None:
        """Create ``directory`` (mode 0700) if needed and probe O_DIRECT unless ``direct_io`` is given."""
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

    def path_for(self, key: BlockKey) -> Path:
        """Return where ``key``'s file lives (two hex characters of fan-out keep directories small)."""
        name = key.hex()
        return self.directory / name[:2] / f"{name}{SUFFIX}"

    def _staging_buffer(self) -> mmap.mmap:
        # One page-aligned buffer per worker thread: O_DIRECT needs aligned memory, and reusing
        # it avoids an allocation (and page faults) per block.
        buffer: mmap.mmap | None = getattr(self._staging, "buffer", None)
        if buffer is None:
            buffer = mmap.mmap(-1, self.file_bytes)
            self._staging.buffer = buffer
        return buffer

    def write(self, key: BlockKey, segments: Sequence[ByteArray]) -> int:
        """Write one block atomically; returns the bytes it occupies on disk.

        Blocks the calling thread (run it on a worker). Raises TierFullError when the disk is full
        and TierError on any other I/O failure; in both cases no file is left behind.
        """
        staging = self._staging_buffer()
        view = memoryview(staging)
        array = np.frombuffer(staging, dtype=np.uint8)
        payload = array[HEADER_BYTES : HEADER_BYTES + self.block_bytes]
        gather_into(payload, segments)
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
                written = 0
                while written < self.file_bytes:
                    count = _pwrite(fd, view[written:], written)
                    if count <= 0:
                        raise OSError(errno.EIO, "short write")
                    written += count
            finally:
                os.close(fd)
            os.replace(temp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                temp.unlink()
            if exc.errno in _FULL_ERRNOS:
                raise TierFullError(f"disk tier full writing {final.name}: {exc.strerror}") from exc
            raise TierError(f"disk tier write failed for {final.name}: {exc}") from exc
        finally:
            view.release()
        return self.file_bytes

    def read_into(self, key: BlockKey, segments: Sequence[ByteArray]) -> bool:
        """Fill ``segments`` with ``key``'s payload; returns False when no file exists.

        Blocks the calling thread. A truncated, mismatched or corrupt file is deleted and raises
        CorruptBlockError before any byte reaches ``segments``. Other I/O failures raise TierError.
        """
        path = self.path_for(key)
        staging = self._staging_buffer()
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
            view = memoryview(staging)
            try:
                while read < self.file_bytes:
                    count = os.preadv(fd, [view[read:]], read)
                    if count <= 0:
                        break
                    read += count
            finally:
                view.release()
        except OSError as exc:
            raise TierError(f"disk tier read failed for {path.name}: {exc}") from exc
        finally:
            os.close(fd)
        if read < self.file_bytes:
            self._discard(path)
            raise CorruptBlockError(f"{path.name} is truncated")
        problem = self._check(staging, key)
        if problem is not None:
            self._discard(path)
            raise CorruptBlockError(f"{path.name}: {problem}")
        array = np.frombuffer(staging, dtype=np.uint8)
        scatter_from(array[HEADER_BYTES : HEADER_BYTES + self.block_bytes], segments)
        return True

    def _check(self, staging: mmap.mmap, key: BlockKey) -> str | None:
        problem, header = self._parse_header(bytes(staging[:HEADER_BYTES]))
        if problem is not None or header is None:
            return problem
        _, _, _, _, _, checksum, digest, fingerprint = header
        if digest != key.digest or fingerprint != key.fingerprint_digest:
            return "header names another key"
        payload = np.frombuffer(staging, dtype=np.uint8)[
            HEADER_BYTES : HEADER_BYTES + self.block_bytes
        ]
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
