from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentkv import serving
from agentkv.cli import app
from agentkv.errors import ConfigError, EngineUnavailableError
from agentkv.serving import ServeOptions, build_server_command, preflight


def test_command_wires_every_plugin_and_the_connector() -> None:
    argv, env = build_server_command(
        ServeOptions(model="/m", port=9001, kv_space_gib=2, extra_args=["--enforce-eager"]),
        base_env={"VLLM_PLUGINS": "other"},
    )
    assert env["VLLM_PLUGINS"].split(",") == ["other", "agentkv", "agentkv_routes"]
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "--enable-prefix-caching" in argv and "--enable-prompt-tokens-details" in argv
    cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert (
        cfg["kv_connector"] == "AgentKVConnector" and cfg["kv_load_failure_policy"] == "recompute"
    )
    assert argv[argv.index("--port") + 1] == "9001" and argv[-1] == "--enforce-eager"
    assert env["AGENTKV_RUN_DIR"].endswith("127.0.0.1-9001")


def test_preflight_missing_model(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config\.json"):
        preflight(ServeOptions(model=str(tmp_path / "nope")))


def test_preflight_port_in_use(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match="already in use"):
            preflight(ServeOptions(model=str(tmp_path), port=port))


def test_preflight_without_vllm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(serving, "is_vllm_installed", lambda: False)
    with pytest.raises(EngineUnavailableError, match="not installed"):
        preflight(ServeOptions(model=str(tmp_path)))


def test_serve_cli_bad_input_is_one_line_exit_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["serve", str(tmp_path / "missing")])
    assert result.exit_code == 2
    assert "no config.json" in result.output and "Traceback" not in result.output


def test_serve_dry_run_passes_extra_args_after_double_dash(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    result = CliRunner().invoke(
        app, ["serve", str(tmp_path), "--port", "8123", "--dry-run", "--", "--enforce-eager"]
    )
    assert result.exit_code == 0, result.output
    argv = json.loads(result.output)["argv"]
    assert (
        argv[argv.index("--model") + 1] == str(tmp_path.resolve()) and argv[-1] == "--enforce-eager"
    )
