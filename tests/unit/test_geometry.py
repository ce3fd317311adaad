"""Geometry from real published configs, checked against equation 1 worked by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv.errors import ConfigError, UnsupportedModelError
from agentkv.geometry import LayerKind, ModelGeometry
from agentkv.units import format_bytes, parse_bytes

CONFIGS = Path(__file__).parent / "configs"


def load(name: str, **kw: object) -> ModelGeometry:
    return ModelGeometry.from_hf_config(CONFIGS / f"{name}.json", **kw)  # type: ignore[arg-type]


def test_llama_70b_is_the_reference_320_kib_per_token() -> None:
    g = load("llama-3.1-70b")
    assert g.attention == "gqa"
    assert g.kv_bytes_per_token() == 2 * 80 * 8 * 128 * 2 == 327_680
    assert g.kv_bytes_per_token(tp=8) == 40_960  # Napkin Math 0.3
    assert g.kv_bytes_per_token(tp=2) == 163_840  # Napkin Math 0.2
    assert g.kv_bytes_per_token(tp=16) == 40_960  # TP > H_kv: one head replicated per rank
    assert g.kv_bytes(32_768) == 32_768 * 327_680
    assert g.num_parameters is not None and abs(g.num_parameters - 70.55e9) < 0.01e9


def test_llama_8b_and_params() -> None:
    g = load("llama-3.1-8b")
    assert g.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2
    assert g.num_parameters == 8_030_261_248  # the published 8.03B
    assert g.weight_dtype_bytes == 2


def test_qwen25_sliding_window_off_means_full_attention() -> None:
    g = load("qwen2.5-7b-instruct")
    assert set(g.layer_kinds) == {LayerKind.FULL}
    assert g.kv_bytes_per_token() == 2 * 28 * 4 * 128 * 2 == 57_344
    assert g.kv_bytes(100_000) == 100_000 * 57_344
    assert g.num_parameters is not None and abs(g.num_parameters - 7.62e9) < 0.01e9


def test_deepseek_v3_mla_latent_without_k_v_factor() -> None:
    g = load("deepseek-v3")
    assert g.attention == "mla" and g.mla_latent_dim == 512 + 64
    assert g.kv_bytes_per_token() == 61 * 576 * 2 == 70_272
    assert g.kv_bytes_per_token(tp=8) == 70_272  # latent replicated on every rank
    assert g.kv_bytes_per_token() * 7 < 2 * 61 * 128 * 128 * 2  # far below MHA of 128 heads
    assert g.kv_bytes_per_token() == load("deepseek-v3", kv_dtype="fp8").kv_bytes_per_token() * 2
    assert g.weight_dtype_bytes == 1  # fp8 checkpoint
    assert g.num_parameters is not None and abs(g.num_parameters - 671e9) < 1e9


def test_gemma2_alternates_local_and_global_layers() -> None:
    g = load("gemma-2-9b")
    assert g.layer_kinds[0] is LayerKind.SLIDING and g.layer_kinds[1] is LayerKind.FULL
    per_layer = 2 * 8 * 256 * 2
    assert g.kv_bytes_per_token() == 42 * per_layer
    assert g.kv_bytes(8192) == 21 * 8192 * per_layer + 21 * 4096 * per_layer


def test_gemma3_nested_text_config_and_pattern_of_six() -> None:
    g = load("gemma-3-27b-it")
    assert g.num_layers == 62 and g.head_dim == 128
    full = [i for i, k in enumerate(g.layer_kinds) if k is LayerKind.FULL]
    assert full == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    per_layer = 2 * 16 * 128 * 2
    assert g.kv_bytes(32_768) == (10 * 32_768 + 52 * 1024) * per_layer
    assert g.kv_bytes(1000) == 1000 * g.kv_bytes_per_token()


def test_mistral_every_layer_windowed() -> None:
    g = load("mistral-7b-v0.1")
    assert g.kv_bytes_per_token() == 131_072
    assert g.kv_bytes(32_768) == g.kv_bytes(4096) == 4096 * 131_072


def test_jamba_hybrid_counts_attention_layers_and_mamba_state() -> None:
    g = load("jamba-v0.1")
    assert g.num_attention_layers == 4 and g.num_state_layers == 28
    assert g.kv_bytes_per_token() == 2 * 4 * 8 * 128 * 2 == 16_384
    d_inner = 2 * 4096
    assert g.state_bytes_per_sequence() == 28 * (d_inner * 3 + d_inner * 16) * 2
    assert g.num_parameters is not None and abs(g.num_parameters - 51.6e9) < 0.1e9


def test_kv_dtype_override_and_unknown_dtype() -> None:
    assert load("llama-3.1-8b", kv_dtype="fp8").kv_bytes_per_token() == 65_536
    assert load("llama-3.1-8b", kv_dtype="int8").kv_dtype == "int8"
    with pytest.raises(ConfigError, match="unknown dtype"):
        load("llama-3.1-8b", kv_dtype="fp4x")


def test_tp_that_does_not_divide_heads_is_an_error() -> None:
    g = load("llama-3.1-70b")
    with pytest.raises(ConfigError, match="does not divide"):
        g.kv_bytes_per_token(tp=3)
    with pytest.raises(ConfigError, match=">= 1"):
        g.kv_bytes_per_token(tp=0)


def test_missing_field_is_named() -> None:
    cfg = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    del cfg["num_hidden_layers"]
    with pytest.raises(UnsupportedModelError, match="num_hidden_layers"):
        ModelGeometry.from_hf_config(cfg)
    cfg = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    del cfg["torch_dtype"]
    with pytest.raises(UnsupportedModelError, match="torch_dtype"):
        ModelGeometry.from_hf_config(cfg)
    assert ModelGeometry.from_hf_config(cfg, kv_dtype="bf16").kv_bytes_per_token() == 131_072


def test_malformed_and_missing_files(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="malformed JSON"):
        ModelGeometry.from_hf_config(tmp_path)  # a model folder
    with pytest.raises(ConfigError, match="not found"):
        ModelGeometry.from_hf_config(tmp_path / "nope.json")
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a JSON object"):
        ModelGeometry.from_hf_config(bad)


@given(
    layers=st.integers(1, 128),
    kv=st.sampled_from([1, 2, 4, 8, 16]),
    group=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([64, 80, 128, 256]),
    tokens=st.integers(0, 1 << 20),
)
def test_equation_one_for_any_dense_geometry(
    layers: int, kv: int, group: int, head_dim: int, tokens: int
) -> None:
    heads = kv * group
    g = ModelGeometry.from_hf_config(
        {
            "num_hidden_layers": layers,
            "hidden_size": heads * head_dim,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "torch_dtype": "bfloat16",
        }
    )
    assert g.kv_bytes_per_token() == 2 * layers * kv * head_dim * 2
    assert g.kv_bytes(tokens) == tokens * g.kv_bytes_per_token()


@given(st.integers(0, 1 << 60), st.sampled_from(["B", "KiB", "MiB", "GiB", "GB", "TB"]))
def test_parse_bytes_reads_what_format_bytes_writes(n: int, unit: str) -> None:
    text = format_bytes(n, unit, digits=12).replace(",", "")
    assert abs(parse_bytes(text) - n) <= max(1, n * 1e-9)


def test_parse_bytes_conventions() -> None:
    assert parse_bytes("526e9") == 526_000_000_000
    assert parse_bytes("480GiB") == 480 * 2**30
    assert parse_bytes("60 GB") == 60 * 10**9
    assert parse_bytes("4096") == 4096
    assert parse_bytes("1.5tib") == 3 * 2**39
    for bad in ("", "-1GB", "12G", "GB", "nan", "1e400"):
        with pytest.raises(ConfigError):
            parse_bytes(bad)
    assert format_bytes(480 * 2**30) == "480.00 GiB"
    assert format_bytes(526 * 10**9, "GB") == "526.00 GB"
