from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from agentkv import serving
from agentkv.cli import app
from agentkv.errors import ConfigError, EngineUnavailableError
from agentkv.serving import ServeOptions, build_server_command, preflight
from agentkv_vllm.settings import RL_SETTINGS, ConnectorSettings


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


def _extra_config(argv: list[str]) -> dict[str, Any]:
    """The connector's settings as the command line hands them to vLLM."""
    cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return dict(cfg["kv_connector_extra_config"])


def test_serve_rl_turns_on_what_an_rl_trainer_needs(tmp_path: Path) -> None:
    """`agentkv serve --rl`: the connector's rl setting, and through it reset_invalidates_tiers,
    implicit_pause and salt_generations; without --rl none of them."""
    (tmp_path / "config.json").write_text("{}")
    result = CliRunner().invoke(app, ["serve", str(tmp_path), "--rl", "--dry-run"])
    assert result.exit_code == 0, result.output
    extra = _extra_config(json.loads(result.output)["argv"])
    assert extra == {"rl": True}
    settings = ConnectorSettings.model_validate(extra)
    on = {name: getattr(settings, name) for name in RL_SETTINGS}
    assert on == {"reset_invalidates_tiers": True, "implicit_pause": True, "salt_generations": True}
    argv, _ = build_server_command(ServeOptions(model="/m"), base_env={})
    plain = ConnectorSettings.model_validate(_extra_config(argv))
    assert not plain.rl and not any(getattr(plain, name) for name in RL_SETTINGS)


def test_serve_rl_keeps_what_the_connector_config_says(tmp_path: Path) -> None:
    """An explicit setting in --connector-config wins over the switch (here: a trainer that
    salts per tenant, not per weight version), and so does an explicit rl."""
    argv, _ = build_server_command(
        ServeOptions(
            model="/m", rl=True, connector_config={"salt_generations": False, "grace_s": 2.0}
        ),
        base_env={},
    )
    extra = _extra_config(argv)
    assert extra == {"rl": True, "salt_generations": False, "grace_s": 2.0}
    settings = ConnectorSettings.model_validate(extra)
    assert settings.reset_invalidates_tiers and settings.implicit_pause
    assert not settings.salt_generations
    argv, _ = build_server_command(
        ServeOptions(model="/m", rl=True, connector_config={"rl": False}), base_env={}
    )
    assert _extra_config(argv) == {"rl": False}
    assert not ConnectorSettings.model_validate({"rl": False}).implicit_pause


def test_serve_help_explains_rl() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200)
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for what in ("--rl", "reset_invalidates_tiers", "implicit_pause", "salt_generations"):
        assert what in text, what


def test_the_rl_setting_reaches_the_manager() -> None:
    """The engine builds its manager from the settings: ``rl`` makes cache_salt a weight
    version there (salt_generations); off, a salt stays a tenant."""
    from agentkv_vllm.engine_config import manager_config

    def built(**settings: Any) -> bool:
        cfg = manager_config(
            ConnectorSettings(**settings),
            block_size=16,
            block_bytes=1 << 20,
            tp_size=1,
            host_blocks=8,
            disk_blocks=0,
            layerwise=False,
        )
        return cfg.salt_generations

    assert built(rl=True) and built(salt_generations=True)
    assert not built() and not built(rl=True, salt_generations=False)
