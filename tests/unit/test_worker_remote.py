"""The worker's remote jobs against a real valkey-server: an upload of confirmed host copies, a
fetch into another replica's host tier that loads bit-identically, misses reported per key, and
a dead server that fails the upload without touching the local copies."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from agentkv.manager.jobs import BlockTransfer, LoadJob, MoveJob, StepPlan, StoreJob  # noqa: E402
from agentkv.tiers.valkey_server import ValkeyProcess  # noqa: E402
from agentkv_vllm.metadata import AgentKVStepMetadata  # noqa: E402
from agentkv_vllm.settings import ConnectorSettings  # noqa: E402
from agentkv_vllm.worker_side import WorkerSide  # noqa: E402
from tests.valkey_fixture import unique_prefix  # noqa: E402

NUM_BLOCKS, HEADS, BLOCK, DIM = 6, 2, 16, 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


@pytest.fixture(scope="module")
def valkey() -> ValkeyProcess:
    with ValkeyProcess() as server:
        yield server


def _worker(url: str, prefix: str) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    caches = {n: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, DIM, dtype=torch.bfloat16) for n in NAMES}
    w = WorkerSide(
        settings=ConnectorSettings(
            host_capacity_gib=0.01, run_dir="/tmp", remote_url=url, remote_key_prefix=prefix
        ),
        model_id="sim",
        tp_rank=0,
        tp_size=1,
        num_blocks=NUM_BLOCKS,
    )
    w.register_kv_caches(caches)
    return w, caches


def _run(w: WorkerSide, **plan: object) -> None:
    w.start_step(AgentKVStepMetadata(StepPlan(**plan)))  # type: ignore[arg-type]
    for pending in [*w._jobs, *w._loads]:
        pending.handle.result()
    w.poll()


def test_upload_then_fetch_on_another_replica_is_bit_identical(valkey: ValkeyProcess) -> None:
    prefix = unique_prefix()
    a, caches_a = _worker(valkey.url, prefix)
    for i, name in enumerate(NAMES):
        caches_a[name][1] = i + 1.5
        caches_a[name][2] = -(i + 2.25)
    blocks = [BlockTransfer(b"k1", 1), BlockTransfer(b"k2", 2)]
    _run(a, stores=[StoreJob(1, "host", blocks, "t")])
    _run(a, moves=[MoveJob(2, "upload", [b"k1", b"k2"])])
    report = a.take_report()
    assert report is not None and report.report.jobs_done.get(2) == 1
    assert 2 not in report.report.jobs_failed

    b, caches_b = _worker(valkey.url, prefix)  # another replica: same model, layout and rank
    _run(b, moves=[MoveJob(7, "fetch", [b"k1", b"k2", b"never-written"])])
    got = b.take_report()
    assert got is not None and got.report.jobs_done.get(7) == 1 and 7 not in got.report.jobs_failed
    assert got.report.fetch_missing == {7: [b"never-written"]}
    _run(b, loads=[LoadJob(8, "r", [BlockTransfer(b"k1", 4), BlockTransfer(b"k2", 5)])])
    for name in NAMES:
        assert torch.equal(caches_b[name][4], caches_a[name][1])
        assert torch.equal(caches_b[name][5], caches_a[name][2])


def test_a_dead_remote_fails_the_upload_and_loses_nothing_local(valkey: ValkeyProcess) -> None:
    w, caches = _worker(valkey.url, unique_prefix())
    for name in NAMES:
        caches[name][1] = 3.0
    _run(w, stores=[StoreJob(1, "host", [BlockTransfer(b"k1", 1)], "t")])
    w.take_report()
    valkey.kill()
    try:
        _run(w, moves=[MoveJob(2, "upload", [b"k1"])])
        report = w.take_report()
        assert report is not None and 2 in report.report.jobs_failed
        assert report.report.bad_keys == {}, "a remote failure must not mark local copies lost"
        _run(w, loads=[LoadJob(3, "r", [BlockTransfer(b"k1", 4)])])
        for name in NAMES:
            assert torch.equal(caches[name][4], caches[name][1])
    finally:
        valkey.start()
