"""KV identity in every tier key: two deployments that differ only in revision, quantization or
KV cache format (fp8_e4m3 vs fp8_e5m2, both stored as uint8) never share a host key, a disk file
or a remote name; the same deployment derives the same keys in another process; a new generation
changes every key; a local weights folder is identified by its configs and weight files."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from agentkv.kv_identity import LogicalKeys, weights_identity  # noqa: E402
from agentkv.tiers.disk import BlockFiles  # noqa: E402
from agentkv.tiers.remote_codec import remote_key  # noqa: E402
from agentkv_vllm.kv_identity import identity_from_config, kv_cache_format  # noqa: E402
from agentkv_vllm.settings import ConnectorSettings  # noqa: E402
from agentkv_vllm.worker_side import WorkerSide  # noqa: E402

NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
BLOCK_HASH = bytes(range(32))


def _config(
    model: str = "org/tiny",
    revision: str | None = None,
    quantization: str | None = None,
    cache_dtype: str = "auto",
) -> Any:
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model=model,
            revision=revision,
            dtype="bfloat16",
            quantization=quantization,
            hf_overrides=None,
        ),
        cache_config=SimpleNamespace(
            block_size=16, cache_dtype=cache_dtype, calculate_kv_scales=False
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )


def _tier_keys(config: Any, tmp: Path) -> tuple[bytes, str, str]:
    """(host key digest, disk file name, remote name) of one block in deployment ``config``."""
    logical = LogicalKeys(
        identity_from_config(config, num_layers=2, layout="logical-v3:test", tp_rank=-1)
    ).key_of(BLOCK_HASH)
    dtype = torch.uint8 if config.cache_config.cache_dtype.startswith("fp8") else torch.bfloat16
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
    assert weights_identity("org/tiny", "abc") != weights_identity("org/tiny", "def")
