"""A forged or damaged remote value is recomputed, and an operator sees it (issue 40, item 13).

A bad tag reads as a plain miss, so only the worker's remote client knows it happened: the
worker carries its client's bad tags and corrupt values (and corrupt disk files) in its step
report, the manager adds them up, and ``/agentkv/v1/status`` (the ``status`` op) and the
Prometheus export show them. Real valkey-server, real WorkerSide and TieredStore, real
SchedulerSide and manager.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("valkey")

import valkey as valkey_client  # noqa: E402

from agentkv.manager.jobs import (  # noqa: E402
    BlockTransfer,
    MoveJob,
    MoveKind,
    Rejection,
    StoreJob,
    WorkerReport,
)
from agentkv.metrics import counter_value  # noqa: E402
from agentkv.prometheus_export import families  # noqa: E402
from agentkv.tier import Tier  # noqa: E402
from agentkv.tiers.remote_auth import HEADER_BYTES  # noqa: E402
from agentkv.tiers.valkey_server import ValkeyProcess  # noqa: E402
from agentkv_vllm.metadata import AgentKVWorkerReport  # noqa: E402
from agentkv_vllm.scheduler_side import SchedulerSide  # noqa: E402
from agentkv_vllm.settings import ConnectorSettings  # noqa: E402
from tests.unit.test_engine_config import _vllm_config  # noqa: E402
from tests.unit.test_worker_remote import NAMES, _run, _worker  # noqa: E402
from tests.valkey_fixture import unique_prefix  # noqa: E402


@pytest.fixture(scope="module")
def valkey() -> ValkeyProcess:
    with ValkeyProcess() as server:
        yield server


def _tamper(url: str, name: str, offset: int) -> None:
    """Flip one byte of the value stored under ``name`` (keeping its TTL)."""
    raw = valkey_client.Valkey.from_url(url)
    try:
        value = bytearray(raw.get(name))
        value[offset] ^= 0xFF
        raw.set(name, bytes(value), keepttl=True)
    finally:
        raw.close()


def test_a_forged_and_a_damaged_remote_value_are_counted_in_the_report_status_and_metrics(
    valkey: ValkeyProcess,
) -> None:
    prefix = unique_prefix()
    a, caches = _worker(valkey.url, prefix)
    for i, name in enumerate(NAMES):
        caches[name][1:4] = i + 1.0
    blocks = [BlockTransfer(k, b) for k, b in ((b"k1", 1), (b"k2", 2), (b"k3", 3))]
    _run(a, stores=[StoreJob(1, Tier.HOST, blocks, "t")])
    _run(a, moves=[MoveJob(2, MoveKind.UPLOAD, [b"k1", b"k2", b"k3"])])
    a.take_report()
    remote = a.store.remote  # type: ignore[union-attr]
    assert remote is not None
    # k1: its tag no longer verifies (a forgery by someone who can write the server but holds
    # no secret); k2: a payload byte flipped (damage); k3 untouched.
    _tamper(valkey.url, remote.name_of(a.rank_key(b"k1")), HEADER_BYTES - 1)
    _tamper(valkey.url, remote.name_of(a.rank_key(b"k2")), HEADER_BYTES + 7)

    b, _ = _worker(valkey.url, prefix)  # another replica fetches the trajectory
    _run(b, moves=[MoveJob(7, MoveKind.FETCH, [b"k1", b"k2", b"k3"])])
    taken = b.take_report()
    assert taken is not None
    report = taken.report
    assert report.fetch_missing == {7: [b"k1", b"k2"]}  # recomputed, never served
    assert report.rejected == {
        (Tier.REMOTE, Rejection.BAD_TAG): 1,
        (Tier.REMOTE, Rejection.CORRUPT): 1,
    }
    # Counted once: the next report of this rank does not carry them again.
    _run(b, moves=[MoveJob(8, MoveKind.FETCH, [b"k3"])])
    again = b.take_report()
    assert again is not None and not again.report.rejected

    # Two TP ranks' reports add up (each rank has its own blocks).
    merged = AgentKVWorkerReport(report).aggregate(AgentKVWorkerReport(report))
    assert merged.report.rejected[(Tier.REMOTE, Rejection.BAD_TAG)] == 2  # type: ignore[attr-defined]

    side = SchedulerSide(*_vllm_config("cpu"), ConnectorSettings())
    side.on_worker_report(NS(kv_connector_worker_meta=taken, invalid_block_ids=None))
    code, status = side.handle({"op": "status"})  # what GET /agentkv/v1/status answers
    assert code == 200
    counters = status["counters"]
    assert counters["remote_bad_tag_blocks"] == 1
    assert counters["remote_corrupt_blocks"] == 1
    assert counters["disk_corrupt_blocks"] == 0  # listed before it ever happens
    snapshot = side.metrics_snapshot()
    assert counter_value(snapshot, "agentkv_rejected_blocks", tier="remote", reason="bad_tag") == 1
    assert counter_value(snapshot, "agentkv_rejected_blocks", tier="remote", reason="corrupt") == 1
    [family] = [f for f in families(snapshot) if f.name == "agentkv_rejected_blocks"]
    samples = {(s.labels["tier"], s.labels["reason"]): s.value for s in family.samples}
    assert samples[("remote", "bad_tag")] == 1.0
    a.shutdown()
    b.shutdown()


def test_a_corrupt_disk_file_is_counted_as_a_rejected_disk_value(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from agentkv.manager.jobs import LoadJob
    from agentkv_vllm.worker_side import WorkerSide

    caches = {n: torch.ones(6, 2, 16, 64, dtype=torch.bfloat16) for n in NAMES}
    w = WorkerSide(
        settings=ConnectorSettings(
            host_capacity_gib=0.01, disk_dir=str(tmp_path), disk_capacity_gib=0.01, run_dir="/tmp"
        ),
        model_id="sim",
        tp_rank=0,
        tp_size=1,
        num_blocks=6,
    )
    w.register_kv_caches(caches)
    _run(w, stores=[StoreJob(1, Tier.DISK, [BlockTransfer(b"k1", 1)], "t")])
    w.take_report()
    [path] = list(tmp_path.rglob("*.kvb"))  # the one block file, wherever the rank keeps it
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the payload's last byte: its checksum no longer matches
    path.write_bytes(bytes(data))
    _run(w, loads=[LoadJob(2, "r", [BlockTransfer(b"k1", 4)])])
    taken = w.take_report()
    assert taken is not None
    assert taken.report.bad_keys == {b"k1": "corrupt"}
    assert taken.report.rejected == {(Tier.DISK, Rejection.CORRUPT): 1}
    assert WorkerReport().rejected == {}
    w.shutdown()
