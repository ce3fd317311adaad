from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agentkv.errors import EngineUnavailableError
from agentkv.launch import (
    SERVER_MODULE,
    LaunchSpec,
    _stop,
    build_launch_command,
    free_port,
    running_server,
)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_vanilla_loads_no_plugin_and_has_no_connector() -> None:
    spec = LaunchSpec(model="/m", kv_space_gib=2, num_blocks=64, served_model_name="small")
    argv, env = build_launch_command(spec, 9100, base_env={"VLLM_PLUGINS": "agentkv,other"})
    # Empty allow-list: vLLM splits it into [""], which names no installed plugin.
    assert env["VLLM_PLUGINS"] == ""
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "--kv-transfer-config" not in argv
    assert argv[1:3] == ["-m", SERVER_MODULE]
    assert "--enable-prefix-caching" in argv and "--enable-prompt-tokens-details" in argv
    assert _flag(argv, "--num-gpu-blocks-override") == "64"
    assert _flag(argv, "--served-model-name") == "small"
    assert _flag(argv, "--port") == "9100"
    assert "--enforce-eager" in argv
    assert "AGENTKV_RUN_DIR" not in env


def test_agentkv_wires_exactly_its_plugins_and_connector_config() -> None:
    spec = LaunchSpec(
        model="/m",
        connector_config={"host_capacity_gib": 2},
        kv_space_gib=1,
        num_blocks=64,
        api_key="k",
        run_dir=Path("/tmp/run-x"),
        extra_args=["--max-num-seqs", "8"],
    )
    argv, env = build_launch_command(spec, 9101, base_env={"VLLM_PLUGINS": "other"})
    # The inherited allow-list is dropped so both configurations load the same foreign plugins.
    assert env["VLLM_PLUGINS"] == "agentkv,agentkv_routes"
    assert env["AGENTKV_RUN_DIR"] == "/tmp/run-x"
    cfg = json.loads(_flag(argv, "--kv-transfer-config"))
    assert cfg["kv_connector"] == "AgentKVConnector"
    assert cfg["kv_connector_extra_config"] == {"host_capacity_gib": 2}
    assert _flag(argv, "--api-key") == "k"
    assert argv[-2:] == ["--max-num-seqs", "8"]


def test_both_configurations_share_every_vllm_argument() -> None:
    common = {"model": "/m", "kv_space_gib": 1, "num_blocks": 96, "max_model_len": 8192}
    vanilla, _ = build_launch_command(LaunchSpec(**common), 9000)  # type: ignore[arg-type]
    plugin, _ = build_launch_command(
        LaunchSpec(connector_config={}, **common),  # type: ignore[arg-type]
        9000,
    )
    i = plugin.index("--kv-transfer-config")
    assert plugin[:i] + plugin[i + 2 :] == vanilla


def test_extra_env_overrides_base() -> None:
    spec = LaunchSpec(model="/m", extra_env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    _, env = build_launch_command(spec, 9000, base_env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_early_exit_raises_with_log_tail(tmp_path: Path) -> None:
    # A "python" that prints and exits stands in for a vLLM that fails at start-up.
    fake = tmp_path / "fake_python"
    fake.write_text(
        textwrap.dedent(
            f"""\
            #!{sys.executable}
            print("boom: model not found")
            raise SystemExit(3)
            """
        )
    )
    fake.chmod(0o755)
    spec = LaunchSpec(model="/m", python=str(fake), log_path=tmp_path / "s.log")
    with (
        pytest.raises(EngineUnavailableError, match=r"exited with code 3[\s\S]*boom"),
        running_server(spec, ready_timeout_s=30, poll_s=0.05),
    ):
        pass


def test_running_server_yields_and_stops_process_group(tmp_path: Path) -> None:
    # A tiny HTTP server answering /health plays the part of vLLM.
    fake = tmp_path / "fake_python"
    fake.write_text(
        textwrap.dedent(
            f"""\
            #!{sys.executable}
            import http.server, sys
            port = int(sys.argv[sys.argv.index("--port") + 1])
            class H(http.server.BaseHTTPRequestHandler):
                def do_GET(self):
                    self.send_response(200 if self.path == "/health" else 404)
                    self.end_headers()
                def log_message(self, *a):
                    pass
            http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
            """
        )
    )
    fake.chmod(0o755)
    spec = LaunchSpec(model="/m", python=str(fake), served_model_name="tiny")
    with running_server(spec, ready_timeout_s=30, poll_s=0.05) as srv:
        assert srv.model == "tiny"
        assert srv.base_url.endswith(f":{srv.port}")
        assert srv.proc.poll() is None
        proc: subprocess.Popen[bytes] = srv.proc
    assert proc.poll() is not None


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


CHILD_KEEPS_RUNNING = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(300)
"""


def test_stop_ends_the_group_of_a_server_that_already_died(tmp_path: Path) -> None:
    """Issue 29: a replica whose API server was killed left its engine core running (parented
    to init) because the stop returned when the leader was gone. The child here plays the
    engine core: same process group, outlives its parent."""
    marker = tmp_path / "child.pid"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD_KEEPS_RUNNING, str(marker)], start_new_session=True
    )
    deadline = time.monotonic() + 30
    while not (marker.exists() and marker.read_text()):
        assert time.monotonic() < deadline, "child did not start"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # the API server dies; its child stays
    proc.wait(timeout=10)
    try:
        assert _group_alive(proc.pid)
        _stop(proc, grace_s=10)
        assert not _group_alive(proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
