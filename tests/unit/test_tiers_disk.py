"""Block files: bit-exact, atomic, 0600, corruption and truncation detected, index rebuilt."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from agentkv.errors import CorruptBlockError, TierFullError
from agentkv.tiers import disk
from agentkv.tiers.disk import HEADER_BYTES, BlockFiles
from agentkv.tiers.keys import ModelFingerprint
from tests.unit.key_helpers import make_keys

BLOCK = 10_000  # not a multiple of 4096: exercises payload padding
KEYS = make_keys(ModelFingerprint("tiny", "bf16", 16, 2), None, range(4))


def payload(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def files(tmp_path: Path, request: pytest.FixtureRequest) -> BlockFiles:
    if request.param and not disk.probe_direct_io(tmp_path):
        pytest.skip("filesystem refuses O_DIRECT")
    return BlockFiles(tmp_path / "kv", BLOCK, direct_io=request.param)


def read(files: BlockFiles, index: int) -> np.ndarray | None:
    out = np.zeros(BLOCK, np.uint8)
    return out if files.read_into(KEYS[index], [out]) else None


def test_round_trip_with_segments_is_bit_exact_and_private(files: BlockFiles) -> None:
    data = payload(1)
    files.write(KEYS[0], [data[:3000], data[3000:]])
    head, tail = np.zeros(1234, np.uint8), np.zeros(BLOCK - 1234, np.uint8)
    assert files.read_into(KEYS[0], [head, tail])
    assert np.array_equal(np.concatenate([head, tail]), data)
    path = files.path_for(KEYS[0])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_size == files.file_bytes
    assert read(files, 1) is None


@pytest.mark.parametrize(
    "offset", [HEADER_BYTES + 5, 40, HEADER_BYTES + BLOCK - 1], ids=["payload", "header", "last"]
)
def test_flipped_byte_is_a_miss_and_deleted(files: BlockFiles, offset: int) -> None:
    files.write(KEYS[0], [payload(2)])
    path = files.path_for(KEYS[0])
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(raw)
    out = np.zeros(BLOCK, np.uint8)
    with pytest.raises(CorruptBlockError):
        files.read_into(KEYS[0], [out])
    assert not out.any(), "no byte of a corrupt block may reach the caller"
    assert not path.exists()


def test_truncated_file_is_a_miss_and_deleted(files: BlockFiles) -> None:
    files.write(KEYS[0], [payload(3)])
    path = files.path_for(KEYS[0])
    os.truncate(path, HEADER_BYTES + BLOCK // 2)
    with pytest.raises(CorruptBlockError, match="truncated"):
        read(files, 0)
    assert not path.exists()


def test_file_renamed_to_another_key_is_rejected(files: BlockFiles) -> None:
    files.write(KEYS[0], [payload(4)])
    files.path_for(KEYS[1]).parent.mkdir(exist_ok=True)
    os.replace(files.path_for(KEYS[0]), files.path_for(KEYS[1]))
    with pytest.raises(CorruptBlockError, match="another key"):
        read(files, 1)


def test_scan_rebuilds_index_and_cleans_leftovers(files: BlockFiles, tmp_path: Path) -> None:
    for i in range(3):
        files.write(KEYS[i], [payload(i)])
    leftover = files.path_for(KEYS[0]).parent / ".tmp-crashed"
    leftover.write_bytes(b"partial")
    os.truncate(files.path_for(KEYS[2]), 100)  # header cut: deleted on scan
    found = BlockFiles(files.directory, BLOCK, direct_io=files.direct_io).scan()
    assert {info.key for info in found} == {KEYS[0], KEYS[1]}
    assert not leftover.exists() and not files.path_for(KEYS[2]).exists()
    assert (
        BlockFiles(files.directory, BLOCK * 2, direct_io=False).scan() == []
    )  # other size: ignored
    assert files.path_for(KEYS[0]).exists()


def test_disk_full_fails_cleanly(files: BlockFiles, monkeypatch: pytest.MonkeyPatch) -> None:
    real = disk._pwrite

    def half_then_full(fd: int, data: memoryview, offset: int) -> int:
        if offset == 0:
            return real(fd, data[:HEADER_BYTES], 0)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk, "_pwrite", half_then_full)
    with pytest.raises(TierFullError):
        files.write(KEYS[0], [payload(5)])
    assert [p for p in files.directory.rglob("*") if p.is_file()] == []
    assert read(files, 0) is None
