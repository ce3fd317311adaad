"""The fleet launcher's commands (pure): what the router and each replica are started with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentkv.cli import app
from agentkv.errors import ConfigError
from agentkv.fleet import FleetSpec, ReplicaPorts, kv_events_config, replica_spec, router_command


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


def test_fleet_up_dry_run_prints_the_router_command() -> None:
    result = CliRunner().invoke(app, ["fleet", "up", "/m", "--replicas", "3", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert result.output.count("--kv-event-source") == 3
    bad = CliRunner().invoke(app, ["fleet", "up", "/m", "--connector-config", "[1]", "--dry-run"])
    assert bad.exit_code == 2
