"""GPUDirect Storage on CPU: the probe's decisions with a stand-in kvikio, and BlockFiles' GDS
branch (header by ordinary I/O, payload through the GDS object, checksum verified on a host copy
before any byte reaches the caller) with a stand-in payload mover over CPU tensors."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from agentkv.errors import CorruptBlockError  # noqa: E402
from agentkv.tiers import gds  # noqa: E402
from agentkv.tiers.device import DeviceSegments  # noqa: E402
from agentkv.tiers.disk import HEADER_BYTES, BlockFiles  # noqa: E402
from agentkv.tiers.keys import ModelFingerprint  # noqa: E402
from tests.unit.key_helpers import make_keys  # noqa: E402

FP = ModelFingerprint("tiny", "bfloat16", 16, 2)


@pytest.fixture(autouse=True)
def _fresh_probe() -> object:
    gds.reset_probe()
    yield
    gds.reset_probe()


def _fake_kvikio(**attrs: object) -> types.ModuleType:
    module = types.ModuleType("kvikio")
    for name, value in attrs.items():
        setattr(module, name, value)
    return module


def _with_cuda(monkeypatch: pytest.MonkeyPatch, kvikio: types.ModuleType | None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "kvikio", kvikio)  # type: ignore[arg-type]


def test_probe_needs_cufile_itself_not_kvikio_compat_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not gds.gds_available()  # no CUDA on this machine
    driver = types.SimpleNamespace(properties=types.SimpleNamespace(is_gds_available=True))
    _with_cuda(monkeypatch, _fake_kvikio(cufile_driver=driver))
    gds.reset_probe()
    assert gds.gds_available()
    driver.properties.is_gds_available = False
    gds.reset_probe()
    assert not gds.gds_available()
    defaults = types.SimpleNamespace(is_compat_mode_preferred=lambda: True)
    _with_cuda(monkeypatch, _fake_kvikio(defaults=defaults))
    gds.reset_probe()
    assert not gds.gds_available()  # kvikio would do POSIX I/O: not GDS
    defaults.is_compat_mode_preferred = lambda: False
    gds.reset_probe()
    assert gds.gds_available()
    monkeypatch.setenv("AGENTKV_GDS", "off")
    gds.reset_probe()
    assert not gds.gds_available()


def test_probe_without_kvikio_is_false(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_cuda(monkeypatch, None)  # a None entry makes the import fail
    assert not gds.gds_available()


class _FakePayloadIO:
    """Moves the payload between a file and a CPU 'device' buffer, as kvikio would on CUDA."""

    def __init__(self) -> None:
        self.writes = self.reads = 0

    def write_payload(self, path: Path, buffer: torch.Tensor, nbytes: int) -> None:
        self.writes += 1
        with open(path, "r+b") as handle:
            handle.seek(HEADER_BYTES)
            handle.write(buffer[:nbytes].numpy().tobytes())

    def read_payload(self, path: Path, buffer: torch.Tensor, nbytes: int) -> None:
        self.reads += 1
        with open(path, "rb") as handle:
            handle.seek(HEADER_BYTES)
            data = bytearray(handle.read(nbytes))
        buffer[:nbytes].copy_(torch.frombuffer(data, dtype=torch.uint8))


@pytest.fixture
def gds_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[BlockFiles, _FakePayloadIO]:
    fake = _FakePayloadIO()
    monkeypatch.setattr(
        BlockFiles,
        "_gds_for",
        lambda self, segments: fake if isinstance(segments, DeviceSegments) else None,
    )
    return BlockFiles(tmp_path, 2 * 4096 + 10, direct_io=False), fake


def test_gds_branch_round_trips_and_writes_the_staged_format(gds_files) -> None:  # type: ignore[no-untyped-def]
    files, fake = gds_files
    size = files.block_bytes
    a, b = make_keys(FP, "gds", range(2))
    data = torch.randint(0, 256, (size,), dtype=torch.uint8)
    files.write(a, DeviceSegments(list(data.split([10, 4096, 4096]))))
    assert fake.writes == 1
    assert files.path_for(a).stat().st_size == files.file_bytes  # padded like a staged file
    host = np.zeros(size, np.uint8)
    assert files.read_into(a, [host])  # the staged path reads the GDS file
    assert np.array_equal(host, data.numpy())
    files.write(b, [data.numpy()])  # staged file, read back through the GDS branch
    out = torch.zeros(size, dtype=torch.uint8)
    assert files.read_into(b, DeviceSegments(list(out.split([4096, size - 4096]))))
    assert fake.reads == 1 and torch.equal(out, data)
    via_gds, staged = files.path_for(a).read_bytes(), files.path_for(b).read_bytes()
    # Same header up to the key digests (magic, version, sizes, payload checksum), same payload.
    assert via_gds[:28] == staged[:28] and via_gds[HEADER_BYTES:] == staged[HEADER_BYTES:]


def test_gds_branch_verifies_before_writing_the_destination(gds_files) -> None:  # type: ignore[no-untyped-def]
    files, _ = gds_files
    [key] = make_keys(FP, "corrupt", range(1))
    files.write(key, DeviceSegments([torch.full((files.block_bytes,), 7, dtype=torch.uint8)]))
    path = files.path_for(key)
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 5] ^= 0xFF
    path.write_bytes(bytes(raw))
    out = torch.zeros(files.block_bytes, dtype=torch.uint8)
    with pytest.raises(CorruptBlockError, match="checksum"):
        files.read_into(key, DeviceSegments([out]))
    assert not bool(out.any())  # nothing reached the caller's block
    assert not path.exists()  # and the corrupt file is gone
    assert not files.read_into(key, DeviceSegments([out]))
