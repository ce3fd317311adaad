"""KV identity in every tier key: two deployments that differ only in revision, quantization or
KV cache format (fp8_e4m3 vs fp8_e5m2, both stored as uint8) never share a host key, a disk file
or a remote name; the same deployment derives the same keys in another process; a new generation
changes every key; a local weights folder is identified by its configs and weight files; a hub
id by the commit of the snapshot loaded, and one whose snapshot is unknown shares nothing with
any other process (issue 40 item 1)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from agentkv.kv_identity import KVIdentity, LogicalKeys, weights_identity  # noqa: E402
from agentkv.tiers.disk import BlockFiles  # noqa: E402
from agentkv.tiers.remote_codec import remote_key  # noqa: E402
from agentkv_vllm.kv_identity import identity_from_config, kv_cache_format  # noqa: E402
from agentkv_vllm.settings import ConnectorSettings  # noqa: E402
from agentkv_vllm.worker_side import WorkerSide  # noqa: E402

NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
BLOCK_HASH = bytes(range(32))


COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def _resolved(commit: str, initial: str | None = None) -> Any:
    """The revision vLLM 0.32 keeps after resolving a hub id (huggingface_hub's)."""
    from huggingface_hub import ResolvedRevision

    return ResolvedRevision(commit, initial, "org/tiny")


def _config(
    model: str = "org/tiny",
    revision: Any = COMMIT_A,
    quantization: str | None = None,
    cache_dtype: str = "auto",
    commit_hash: str | None = None,
) -> Any:
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model=model,
            revision=revision,
            dtype="bfloat16",
            quantization=quantization,
            hf_overrides=None,
            hf_config=SimpleNamespace(_commit_hash=commit_hash),
        ),
        cache_config=SimpleNamespace(
            block_size=16, cache_dtype=cache_dtype, calculate_kv_scales=False
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )


def _tier_keys(config: Any, tmp: Path, tensor_dtype: Any = None) -> tuple[bytes, str, str]:
    """(host key digest, disk file name, remote name) of one block in deployment ``config``."""
    logical = LogicalKeys(
        identity_from_config(config, num_layers=2, layout="logical-v3:test", tp_rank=-1)
    ).key_of(BLOCK_HASH)
    dtype = torch.uint8 if config.cache_config.cache_dtype.startswith("fp8") else torch.bfloat16
    dtype = tensor_dtype or dtype
    worker = WorkerSide(
        settings=ConnectorSettings(host_capacity_gib=0.01, run_dir=str(tmp)),
        model_id=config.model_config.model,
        tp_rank=0,
        tp_size=1,
        num_blocks=2,
        identity=identity_from_config(config, num_layers=0, layout="", tp_rank=0),
    )
    worker.register_kv_caches({n: torch.zeros(2, 2, 16, 8, dtype=dtype) for n in NAMES})
    key = worker.rank_key(logical)
    worker.shutdown()
    disk = BlockFiles(tmp / "disk", 64, direct_io=False).path_for(key).name
    return key.digest, disk, remote_key("agentkv", key)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (_config(revision="r1"), _config(revision="r2")),
        (_config(), _config(quantization="awq")),
        (_config(cache_dtype="fp8_e4m3"), _config(cache_dtype="fp8_e5m2")),
        (_config(cache_dtype="auto"), _config(cache_dtype="fp8")),
    ],
    ids=["revision", "quantization", "fp8-format", "kv-dtype"],
)
def test_deployments_that_differ_share_no_tier_key(a: Any, b: Any, tmp_path: Path) -> None:
    keys_a, keys_b = _tier_keys(a, tmp_path), _tier_keys(b, tmp_path)
    for tier, ka, kb in zip(("host", "disk", "remote"), keys_a, keys_b, strict=True):
        assert ka != kb, f"{tier} key shared between deployments"


def test_the_same_deployment_derives_the_same_keys(tmp_path: Path) -> None:
    assert _tier_keys(_config(revision="r1"), tmp_path) == _tier_keys(
        _config(revision="r1"), tmp_path
    )


def test_every_identity_field_is_in_the_digest() -> None:
    """Dropping any field from KVIdentity.digest (kv_cache_dtype with the rest) fails here:
    deployments whose tensors look alike (fp8 formats are all uint8) differ only there."""
    base = KVIdentity(model="m", revision="r", weights="w", quantization="q", dtype="bfloat16")
    base = dataclasses.replace(base, kv_cache_dtype="fp8_e4m3:float8_e4m3fn", layout="l")
    for field in dataclasses.fields(KVIdentity):
        value = getattr(base, field.name)
        other = value + 7 if isinstance(value, int) else value + "-other"
        changed = dataclasses.replace(base, **{field.name: other})
        assert changed.digest() != base.digest(), f"{field.name} is not in the digest"


def test_the_kv_cache_dtype_alone_separates_keys_over_the_same_tensors(tmp_path: Path) -> None:
    """auto vs fp8 on tensors of one dtype: only kv_cache_dtype tells them apart (the older
    kv-dtype case also differed in the tensors' dtype, so it passed without the field)."""
    auto, fp8 = _config(cache_dtype="auto"), _config(cache_dtype="fp8")
    auto_keys = _tier_keys(auto, tmp_path, tensor_dtype=torch.uint8)
    fp8_keys = _tier_keys(fp8, tmp_path, tensor_dtype=torch.uint8)
    for tier, ka, kb in zip(("host", "disk", "remote"), auto_keys, fp8_keys, strict=True):
        assert ka != kb, f"{tier} key shared between auto and fp8"


@pytest.mark.parametrize(
    "how",
    ["resolved-revision", "commit-revision", "hf-config-commit-hash"],
)
def test_a_hub_id_is_identified_by_the_commit_loaded(how: str, tmp_path: Path) -> None:
    """Two replicas on either side of a push to main: the same id and revision name, other
    commits, no shared key; the same commit: the same keys."""

    def config(commit: str) -> Any:
        if how == "resolved-revision":
            return _config(revision=_resolved(commit))  # str(revision) == "main" for both
        if how == "commit-revision":
            return _config(revision=commit)
        return _config(revision="main", commit_hash=commit)

    before, after = _tier_keys(config(COMMIT_A), tmp_path), _tier_keys(config(COMMIT_B), tmp_path)
    for tier, ka, kb in zip(("host", "disk", "remote"), before, after, strict=True):
        assert ka != kb, f"{tier} key shared across a push to main"
    assert _tier_keys(config(COMMIT_A), tmp_path) == before
    from agentkv_vllm.kv_identity import config_weights

    weights = config_weights(config(COMMIT_A).model_config)
    assert weights.shared and weights.name == f"hub:org/tiny@{COMMIT_A}"


_OTHER_PROCESS = """
import sys
from types import SimpleNamespace
from agentkv_vllm.kv_identity import identity_from_config
config = SimpleNamespace(
    model_config=SimpleNamespace(
        model="org/tiny", revision=None, dtype="bfloat16", quantization=None, hf_overrides=None
    ),
    cache_config=SimpleNamespace(block_size=16, cache_dtype="auto", calculate_kv_scales=False),
    parallel_config=SimpleNamespace(tensor_parallel_size=1),
)
print(identity_from_config(config, num_layers=2, layout="x", tp_rank=-1).digest().hex())
"""


@pytest.mark.parametrize("revision", [None, "main"])
def test_a_hub_id_whose_snapshot_is_unknown_shares_nothing(revision: str | None) -> None:
    """No commit known: another process (a replica, a restart) never derives this one's
    identity, so no remote copy, disk file or manifest of another process can match."""
    config = _config(revision=revision)
    here = identity_from_config(config, num_layers=2, layout="x", tp_rank=-1).digest().hex()
    assert here == identity_from_config(config, num_layers=2, layout="x", tp_rank=-1).digest().hex()
    other = subprocess.run(
        [sys.executable, "-c", _OTHER_PROCESS.replace("revision=None", f"revision={revision!r}")],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[2],
    ).stdout.strip()
    assert len(other) == 32
    assert other != here, "an unidentified hub snapshot is shared with another process"
    from agentkv_vllm.kv_identity import config_weights

    weights = config_weights(config.model_config)
    assert not weights.shared and "pin --revision" in weights.why


def test_fp8_and_fp8_e4m3_are_one_format_e5m2_another() -> None:
    cache = SimpleNamespace(cache_dtype="fp8", calculate_kv_scales=False)
    e4m3 = SimpleNamespace(cache_dtype="fp8_e4m3", calculate_kv_scales=False)
    e5m2 = SimpleNamespace(cache_dtype="fp8_e5m2", calculate_kv_scales=False)
    assert kv_cache_format(cache, "bfloat16") == kv_cache_format(e4m3, "bfloat16")
    assert kv_cache_format(e4m3, "bfloat16") != kv_cache_format(e5m2, "bfloat16")
    dynamic = SimpleNamespace(cache_dtype="fp8_e4m3", calculate_kv_scales=True)
    assert kv_cache_format(dynamic, "bfloat16") != kv_cache_format(e4m3, "bfloat16")


def test_a_new_generation_changes_every_key() -> None:
    keys = LogicalKeys(identity_from_config(_config(), num_layers=2, layout="x", tp_rank=-1))
    before = keys.key_of(BLOCK_HASH)
    first = keys.generation
    keys.new_generation()
    assert keys.generation != first
    assert keys.key_of(BLOCK_HASH) != before


def test_a_local_weights_folder_is_identified_by_configs_and_weight_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 128)
    first = weights_identity(str(tmp_path))
    assert first == weights_identity(str(tmp_path))  # stable
    (tmp_path / "config.json").write_text('{"hidden_size": 65}')
    second = weights_identity(str(tmp_path))
    assert second != first
    os.utime(weights, ns=(1, 1))  # new weights copied in place: mtime changes
    assert weights_identity(str(tmp_path)) != second
    assert weights_identity("org/tiny", COMMIT_A) != weights_identity("org/tiny", COMMIT_B)


def test_a_hub_cache_snapshot_folder_is_identified_by_its_path(tmp_path: Path) -> None:
    """A local folder ``.../snapshots/<hash>``: two snapshots with alike files differ."""
    names = []
    for commit in (COMMIT_A, COMMIT_B):
        snapshot = tmp_path / "models--org--tiny" / "snapshots" / commit
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text("{}")
        names.append(weights_identity(str(snapshot)))
    assert names[0] != names[1] and all(w.shared for w in names)


def _engine_config(revision: Any) -> tuple[Any, Any]:
    """A scheduler's vLLM config serving hub id ``org/tiny`` at ``revision``."""
    spec = SimpleNamespace(page_size_bytes=4096, num_kv_heads=2, head_size=64)
    groups = [SimpleNamespace(layer_names=["l0", "l1"], kv_cache_spec=spec)]
    config = _config(revision=revision)
    config.model_config.hf_config = SimpleNamespace(to_dict=lambda: {})
    config.parallel_config.data_parallel_rank = 0
    config.device_config = SimpleNamespace(device_type="cpu")
    config.kv_events_config = None
    return config, SimpleNamespace(kv_cache_groups=groups)


@pytest.mark.parametrize("resolved", [True, False])
def test_status_and_log_say_whether_kv_is_shared(
    resolved: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from agentkv_vllm.scheduler_side import SchedulerSide

    revision = _resolved(COMMIT_A) if resolved else None
    with caplog.at_level("WARNING", logger="agentkv.scheduler"):
        side = SchedulerSide(*_engine_config(revision), ConnectorSettings())
    identity = side.status()["identity"]
    warnings = [r for r in caplog.records if "not shared" in r.getMessage()]
    if resolved:
        assert identity == {"weights": f"hub:org/tiny@{COMMIT_A}", "shared": True, "why": None}
        assert not warnings
    else:
        assert identity["shared"] is False and "pin --revision" in identity["why"]
        assert len(warnings) == 1 and "org/tiny" in warnings[0].getMessage()
    side.close()
