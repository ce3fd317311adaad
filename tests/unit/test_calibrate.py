"""Hardware profile I/O and the measurements (small sizes; prefill against a fake transport)."""

from __future__ import annotations

import builtins
import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from agentkv import calibrate as cal
from agentkv.cli import app
from agentkv.errors import ConfigError, EngineUnavailableError
from agentkv.profile import (
    DEFAULT_PROFILE,
    PROFILE_ENV,
    HardwareProfile,
    MachineInfo,
    default_profile_path,
    load_profile,
    save_profile,
)

MiB = 2**20
runner = CliRunner()


# ---- profile ---------------------------------------------------------------------------------


def test_missing_profile_gives_marked_defaults(tmp_path: Path) -> None:
    profile = load_profile(tmp_path / "nope.json")
    assert profile is DEFAULT_PROFILE
    assert profile.source == "default"
    assert profile.measured_at is None


def test_profile_round_trip(tmp_path: Path) -> None:
    profile = HardwareProfile(
        host_copy_bytes_per_s=12.5e9,
        host_to_device_bytes_per_s=50e9,
        device_to_host_bytes_per_s=48e9,
        disk_write_bytes_per_s=2e9,
        disk_read_bytes_per_s=3e9,
        disk_dir="/nvme",
        disk_direct_io=True,
        prefill_tokens_per_s=9000.0,
        prefill_model="tiny",
        measured_at="2025-01-01T00:00:00+00:00",
        machine=MachineInfo(hostname="h", platform="p", cpu_count=2, python="3.11", gpu="H100"),
    )
    path = save_profile(profile, tmp_path / "sub" / "profile.json")
    assert path.exists()
    assert load_profile(path) == profile
    assert not list(path.parent.glob(".profile-*"))  # no temp file left behind


def test_env_var_sets_the_default_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "env.json"
    monkeypatch.setenv(PROFILE_ENV, str(target))
    assert default_profile_path() == target
    save_profile(HardwareProfile(host_copy_bytes_per_s=1e9))
    assert load_profile().host_copy_bytes_per_s == 1e9
    monkeypatch.delenv(PROFILE_ENV)
    assert default_profile_path() == Path.home() / ".cache" / "agentkv" / "profile.json"


def test_unknown_keys_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps({"host_copy_bytes_per_s": 3e9, "future_field": 1, "machine": {"x": 1}})
    )
    assert load_profile(path).host_copy_bytes_per_s == 3e9


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        "[1, 2]",
        json.dumps({}),
        json.dumps({"host_copy_bytes_per_s": -1}),
        json.dumps({"host_copy_bytes_per_s": 1e9, "disk_read_bytes_per_s": 0}),
        json.dumps({"host_copy_bytes_per_s": "fast"}),
    ],
)
def test_bad_profile_is_a_config_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=str(path)):
        load_profile(path)


def test_profile_rejects_non_positive_rates() -> None:
    with pytest.raises(ConfigError):
        HardwareProfile(host_copy_bytes_per_s=math.nan)


# ---- measurements ----------------------------------------------------------------------------


def test_host_copy_is_measured() -> None:
    rate = cal.measure_host_copy(4 * MiB, repeats=3)
    assert math.isfinite(rate)
    assert rate > 1e7  # even a busy CPU copies far more than 10 MB/s


def test_host_copy_rejects_tiny_buffers() -> None:
    with pytest.raises(ConfigError):
        cal.measure_host_copy(10)


def test_disk_is_measured_and_cleaned_up(tmp_path: Path) -> None:
    result = cal.measure_disk(tmp_path, 2 * MiB + 1)
    assert result.write_bytes_per_s > 0
    assert result.read_bytes_per_s > 0
    assert result.directory == str(tmp_path)
    assert isinstance(result.direct_io, bool)
    assert list(tmp_path.iterdir()) == []


def test_disk_rejects_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        cal.measure_disk(tmp_path / "missing", MiB)


def test_no_torch_means_no_device_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_torch(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "torch":
            raise ImportError("no torch here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    assert cal.measure_host_device(MiB) is None
    assert cal.gpu_name() is None


def test_calibrate_builds_a_measured_profile(tmp_path: Path) -> None:
    lines: list[str] = []
    profile = cal.calibrate(
        disk_dir=tmp_path, nbytes=MiB, measure_device=False, progress=lines.append
    )
    assert profile.source == "measured"
    assert profile.host_copy_bytes_per_s > 0
    assert profile.disk_write_bytes_per_s and profile.disk_read_bytes_per_s
    assert profile.prefill_tokens_per_s is None
    assert profile.host_to_device_bytes_per_s is None
    assert profile.measured_at is not None
    assert profile.machine.cpu_count > 0
    assert any("host copy" in line for line in lines)
    assert any("disk" in line for line in lines)


# ---- prefill against a fake OpenAI-compatible server ---------------------------------------


class FakeServer:
    """Counts one token per word, like the calibration prompt is built to."""

    def __init__(self, fail: bool = False) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.fail = fail

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "max_model_len": 512}]})
        if self.fail:
            return httpx.Response(500, json={"error": "boom"})
        body = json.loads(request.content)
        self.bodies.append(body)
        words = len(body["prompt"].split())
        return httpx.Response(
            200, json={"usage": {"prompt_tokens": words + 1}, "choices": [{"text": "x"}]}
        )


def test_prefill_measurement_uses_uncached_short_and_long_prompts() -> None:
    server = FakeServer()
    client = httpx.Client(base_url="http://fake", transport=httpx.MockTransport(server))
    result = cal.measure_prefill("http://fake", prompt_tokens=4096, client=client)
    assert result.model == "tiny"
    assert result.tokens_per_s > 0
    assert result.long_tokens <= 512  # capped by max_model_len
    assert result.long_tokens > result.short_tokens
    assert len(server.bodies) == 3  # warm-up, short, long
    assert all(b["max_tokens"] == 1 for b in server.bodies)
    assert len({b["cache_salt"] for b in server.bodies}) == 3
    assert len({b["prompt"] for b in server.bodies}) == 3


def test_prefill_server_error_is_engine_unavailable() -> None:
    client = httpx.Client(
        base_url="http://fake", transport=httpx.MockTransport(FakeServer(fail=True))
    )
    with pytest.raises(EngineUnavailableError):
        cal.measure_prefill("http://fake", client=client)


def test_prefill_unreachable_server() -> None:
    with pytest.raises(EngineUnavailableError):
        cal.measure_prefill("http://127.0.0.1:9", timeout_s=2.0)


# ---- CLI -------------------------------------------------------------------------------------


@pytest.fixture
def no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # Importing torch costs seconds on a small CI box; the GPU path is checked on GPU machines.
    monkeypatch.setattr(cal, "measure_host_device", lambda *a, **k: None)


@pytest.mark.usefixtures("no_device")
def test_cli_calibrate_json_and_saves(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    result = runner.invoke(
        app, ["calibrate", "--disk-dir", str(tmp_path), "--size", "1MiB", "-o", str(out), "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["path"] == str(out)
    assert data["profile"]["source"] == "measured"
    assert data["profile"]["disk_write_bytes_per_s"] > 0
    assert load_profile(out).host_copy_bytes_per_s == data["profile"]["host_copy_bytes_per_s"]


@pytest.mark.usefixtures("no_device")
def test_cli_calibrate_no_save(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    result = runner.invoke(
        app, ["calibrate", "--no-disk", "--size", "1MiB", "-o", str(out), "--no-save"]
    )
    assert result.exit_code == 0, result.output
    assert "host copy" in result.output
    assert not out.exists()


@pytest.mark.parametrize(
    "args",
    [
        ["calibrate", "--size", "lots", "--no-save"],
        ["calibrate", "--size", "1", "--no-save", "--no-disk"],
        ["calibrate", "--disk-dir", "/definitely/not/here", "--size", "1MiB", "--no-save"],
    ],
)
@pytest.mark.usefixtures("no_device")
def test_cli_calibrate_bad_input_exit_2(args: list[str]) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
