"""The fleet launcher's commands (pure): what the router and each replica are started with."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentkv.cli import app
from agentkv.errors import ConfigError
from agentkv.fleet import FleetSpec, ReplicaPorts, kv_events_config, replica_spec, router_command
from agentkv.fleet_plan import (
    available_memory_gib,
    detect_gpus,
    model_gib,
    plan_fleet,
    state_dir,
)


def test_router_command_wires_events_affinity_and_tier_credits() -> None:
    spec = FleetSpec(model="/m", served_model_name="tiny", affinity_ttl_s=30)
    argv = router_command(
        spec, 9000, [("http://a:1", "tcp://a:2"), ("http://b:1", "tcp://b:2")], 9100
    )
    joined = " ".join(argv)
    assert "--policy kv_aware" in joined and "--worker-urls http://a:1 http://b:1" in joined
    assert "--kv-event-source http://a:1=tcp://a:2" in joined
    assert "--kv-event-source http://b:1=tcp://b:2" in joined
    assert "--kv-event-model tiny" in joined and "--kv-event-block-size 128" in joined
    assert "--kv-aware-session-affinity-ttl-secs 30" in joined
    assert "--kv-penalty-host 0.8" in joined and "--kv-penalty-disk 0.3" in joined
    assert "--prometheus-port 9100" in joined


def test_round_robin_gets_no_kv_event_flags() -> None:
    argv = router_command(
        FleetSpec(model="/m", policy="round_robin"), 9000, [("http://a:1", "tcp://a:2")]
    )
    assert not any(a.startswith("--kv-") for a in argv)


def test_replica_gets_events_and_remote_tier(tmp_path: Path) -> None:
    spec = FleetSpec(model="/m", work_dir=tmp_path, connector_config={"host_capacity_gib": 1})
    launch = replica_spec(spec, 1, ReplicaPorts(8001, 5557), "valkey://127.0.0.1:6379/0")
    assert launch.connector_config == {
        "host_capacity_gib": 1,
        "remote_url": "valkey://127.0.0.1:6379/0",
    }
    i = list(launch.extra_args).index("--kv-events-config")
    events = json.loads(launch.extra_args[i + 1])
    assert events == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
    }
    assert launch.run_dir == tmp_path / "run-1"  # one control channel directory per replica
    vanilla = replica_spec(FleetSpec(model="/m", vanilla=True), 0, ReplicaPorts(1, 2), None)
    assert vanilla.connector_config is None


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ConfigError, match="replicas"):
        FleetSpec(model="/m", replicas=0)
    with pytest.raises(ConfigError, match="policy"):
        FleetSpec(model="/m", policy="fastest")
    assert kv_events_config("tcp://10.0.0.1:5557").endswith('"tcp://10.0.0.1:5557"}')


@pytest.fixture
def cpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU machine with 20 GiB available (whatever this one has)."""
    from agentkv import fleet_plan

    monkeypatch.setattr(fleet_plan, "detect_gpus", lambda: [])
    monkeypatch.setattr(fleet_plan, "available_memory_gib", lambda: 20.0)


def test_fleet_up_dry_run_prints_the_router_command(cpu_machine: None) -> None:
    result = CliRunner().invoke(app, ["fleet", "up", "/m", "--replicas", "3", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert result.output.count("--kv-event-source") == 3
    bad = CliRunner().invoke(app, ["fleet", "up", "/m", "--connector-config", "[1]", "--dry-run"])
    assert bad.exit_code == 2


# ------------------------------------------------------------------------ fits the machine


def test_cpu_defaults_share_the_free_memory_and_say_so(cpu_machine: None) -> None:
    """Issue 29: with no --kv-space-gib every CPU replica asked vLLM for 92% of the node."""
    result = CliRunner().invoke(app, ["fleet", "up", "/m", "--dry-run"])
    assert result.exit_code == 0, result.output
    # 0.8 x 20 GiB - 2 x 3 GiB for the processes, split in two
    assert "2 replicas -> --kv-space-gib 5 each" in result.output


def test_cpu_plan_numbers_and_refusal() -> None:
    plan = plan_fleet(replicas=None, kv_space_gib=None, gpus=[], available_gib=lambda: 15.7)
    assert (plan.replicas, plan.kv_space_gib, plan.device_groups) == (2, 3, [])
    plan = plan_fleet(
        replicas=3, kv_space_gib=None, gpus=[], available_gib=lambda: 40.0, weights_gib=1.0
    )
    assert plan.kv_space_gib == math.floor((0.8 * 40 - 3 * 4.0) / 3)
    given = plan_fleet(replicas=4, kv_space_gib=2, gpus=[], available_gib=lambda: 1 / 0)
    assert given.kv_space_gib == 2  # an explicit size is never second-guessed (nor probed)
    with pytest.raises(ConfigError, match=r"do not fit in 8\.0 GiB"):
        plan_fleet(replicas=3, kv_space_gib=None, gpus=[], available_gib=lambda: 8.0)


def test_cuda_one_replica_per_gpu_group() -> None:
    plan = plan_fleet(
        replicas=None, kv_space_gib=None, gpus=["0", "1", "2", "3"], available_gib=dead
    )
    assert plan.replicas == 4 and plan.device_groups == [["0"], ["1"], ["2"], ["3"]]
    plan = plan_fleet(
        replicas=None,
        kv_space_gib=None,
        gpus_per_replica=2,
        gpus=["4", "5", "6"],
        available_gib=dead,
    )
    assert plan.device_groups == [["4", "5"]]
    with pytest.raises(ConfigError, match="do not fit on 2 visible"):
        plan_fleet(replicas=3, kv_space_gib=None, gpus=["0", "1"], available_gib=dead)
    spec = FleetSpec(model="/m", replicas=2, device_groups=[["0", "1"], ["2", "3"]])
    launch = replica_spec(spec, 1, ReplicaPorts(1, 2), None)
    assert launch.extra_env["CUDA_VISIBLE_DEVICES"] == "2,3"
    args = list(launch.extra_args)
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    single = replica_spec(
        FleetSpec(model="/m", replicas=1, device_groups=[["7"]]), 0, ReplicaPorts(1, 2), None
    )
    assert "--tensor-parallel-size" not in single.extra_args
    with pytest.raises(ConfigError, match="device groups"):
        FleetSpec(model="/m", replicas=2, device_groups=[["0"]])


def dead() -> float:
    raise AssertionError("a CUDA plan never reads host memory")


def test_gpu_detection() -> None:
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    smi = "GPU 0: NVIDIA H200 (UUID: GPU-a)\nGPU 1: NVIDIA H200 (UUID: GPU-b)\n"
    assert detect_gpus({}, run=lambda argv: smi) == ["0", "1"]
    assert detect_gpus({}, run=lambda argv: None) == []


def test_logs_default_to_a_per_user_state_dir(tmp_path: Path) -> None:
    """Not ./agentkv-fleet in whatever directory fleet up was started from."""
    assert state_dir({"HOME": "/home/u"}) == Path("/home/u/.local/state/agentkv")
    assert state_dir({"HOME": "/h", "XDG_STATE_HOME": "/x"}) == Path("/x/agentkv")
    assert state_dir({"AGENTKV_STATE_DIR": str(tmp_path)}) == tmp_path
    assert FleetSpec(model="/m").work_dir.is_absolute()


def test_meminfo_and_weights(tmp_path: Path) -> None:
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24000000 kB\nMemAvailable:   16777216 kB\n")
    assert available_memory_gib(str(info)) == 16.0
    with pytest.raises(ConfigError, match="MemAvailable"):
        available_memory_gib(str(tmp_path / "none"))
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1024)
    (tmp_path / "config.json").write_text("{}")
    assert model_gib(str(tmp_path)) == 1024 / 1024**3
    assert model_gib("org/hub-model") == 0.0
