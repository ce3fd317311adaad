"""GPU presets: published figures in, the reference's worked numbers out; the CLI takes them."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from agentkv.cli import app
from agentkv.errors import ConfigError
from agentkv.hardware import get_preset
from agentkv.simulate.costs import Provenance
from agentkv.simulate.presets import MODELS, get_model, gpu_costs, gpu_num_blocks


def test_kv_bytes_per_token_follow_the_published_geometries() -> None:
    assert get_model("llama-3.1-8b").kv_bytes_per_token == 128 * 1024
    assert get_model("Llama-3.1-70B").kv_bytes_per_token == 320 * 1024  # the reference's figure
    assert get_model("deepseek-v2-lite").kv_bytes_per_token == 31_104  # MLA: ~4x less than GQA
    with pytest.raises(ConfigError):
        get_model("gpt-5")


def test_a_70b_model_needs_two_h100s_and_more_hbm_holds_more_blocks() -> None:
    h100, h200, m = get_preset("H100"), get_preset("H200"), MODELS["llama-3.1-70b"]
    with pytest.raises(ConfigError):
        gpu_costs("H100", "llama-3.1-70b", 1)
    assert gpu_num_blocks(h200, m, 2) > 5 * gpu_num_blocks(h100, m, 2)
    c = gpu_costs("H200", "llama-3.1-70b", 2)
    assert c.provenance is Provenance.PRESET and "datasheet" in c.source


def test_the_reference_worked_numbers_come_out_of_the_cost_model() -> None:
    # Napkin Math 0.5 of the domain text: 800 TFLOPS, 3.0 TB/s, a 70B model, 60% MFU.
    c = replace(
        gpu_costs("H100", "llama-3.1-70b", 2),
        model_params=70e9,
        prefill_flops_per_s=480e12,
        step_overhead_s=140e9 / 3.0e12,
        decode_seq_s=2 * 70e9 / 480e12,
        decode_context_s_per_token=0.0,
    )
    assert c.step_s(32 * c.decode_token_s(0)) == pytest.approx(0.0467, rel=0.01)  # memory-bound
    assert c.step_s(544 * c.linear_s_per_token) == pytest.approx(0.1587, rel=0.01)  # chunk
    assert 4096 * c.linear_s_per_token == pytest.approx(1.1947, rel=0.01)  # monolithic


def test_simulate_runs_on_a_gpu_preset() -> None:
    out = CliRunner().invoke(
        app,
        ["simulate", "--gpu", "H200", "--model", "llama-3.1-8b", "-n", "4", "-t", "3", "--json"],
    )
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["costs"]["provenance"] == "hardware preset"
    run = data["results"]["session-affinity/agentkv"]
    assert run["config"]["num_blocks"] > 10_000 and run["summary"]["turns"] == 12
    bad = CliRunner().invoke(app, ["simulate", "--gpu", "H100", "--model", "llama-3.1-70b"])
    assert bad.exit_code != 0 and "does not fit" in bad.output
