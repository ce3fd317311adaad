"""agentkv_bench.calibrate_load: the profile's server is the trace bench's vanilla one."""

from __future__ import annotations

from pathlib import Path

from agentkv.launch import build_launch_command
from agentkv_bench.calibrate_load import ProfileRunOptions, launch_spec


def test_the_profile_server_is_vanilla_vllm_with_the_benchs_settings(tmp_path: Path) -> None:
    opts = ProfileRunOptions(num_blocks=96, max_model_len=4096)
    spec = launch_spec(opts, "/models/small", tmp_path / "log", tmp_path / "run")
    assert spec.connector_config is None  # no agentkv, no plugin: the engine alone
    assert spec.num_blocks == 96 and spec.max_model_len == 4096
    assert spec.served_model_name == "small" and spec.kv_space_gib == 1
    # Both cores for the worker, as every trace-bench configuration runs.
    assert spec.extra_env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    argv, env = build_launch_command(spec, 8123, base_env={})
    assert env["VLLM_PLUGINS"] == "" and "--num-gpu-blocks-override" in argv
    assert not any("kv-transfer-config" in a or "kv_transfer_config" in a for a in argv)
