"""The measured hardware profile that pause decisions rest on, and where it lives.

Primitives:
    MachineInfo          which machine a profile was measured on (host, CPU, GPU, Python)
    HardwareProfile      bandwidths (bytes/s) and prefill rate (tokens/s), when and where measured
    DEFAULT_PROFILE      conservative figures used when nothing was measured (source='default')
    default_profile_path $AGENTKV_PROFILE, else ~/.cache/agentkv/profile.json
    load_profile         read a profile JSON; the defaults when there is none
    save_profile         write a profile JSON atomically

The file is a config file read at the edge, so it is validated with pydantic (a TypeAdapter over
the dataclass: one definition, no parallel model) and any problem becomes a ConfigError naming
the path. Unknown keys are ignored so older readers accept newer files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agentkv.errors import ConfigError

PROFILE_ENV = "AGENTKV_PROFILE"
SCHEMA_VERSION = 1

ProfileSource = Literal["measured", "default"]


@dataclass(frozen=True)
class MachineInfo:
    """Identity of the machine a profile describes (for telling stale profiles apart)."""

    hostname: str = ""
    platform: str = ""
    cpu_count: int = 0
    python: str = ""
    gpu: str | None = None

    @classmethod
    def current(cls, gpu: str | None = None) -> MachineInfo:
        """This machine, as the standard library sees it; ``gpu`` is the accelerator's name."""
        return cls(
            hostname=socket.gethostname(),
            platform=platform.platform(),
            cpu_count=os.cpu_count() or 0,
            python=platform.python_version(),
            gpu=gpu,
        )


@dataclass(frozen=True)
class HardwareProfile:
    """Measured rates of one machine, in bytes per second and tokens per second.

    None means "not measured" (no GPU, no disk measured, no server given); consumers then use a
    conservative default or turn that path off.
    """

    host_copy_bytes_per_s: float
    """Large-buffer memcpy in host memory (the host tier's own copy rate)."""
    host_to_device_bytes_per_s: float | None = None
    device_to_host_bytes_per_s: float | None = None
    disk_write_bytes_per_s: float | None = None
    disk_read_bytes_per_s: float | None = None
    disk_dir: str | None = None
    disk_direct_io: bool = False
    """True when the disk figures bypassed the page cache (O_DIRECT)."""
    prefill_tokens_per_s: float | None = None
    prefill_model: str | None = None
    measured_at: str | None = None
    """ISO 8601 UTC time of the measurement; None for the defaults."""
    machine: MachineInfo = field(default_factory=MachineInfo)
    source: ProfileSource = "measured"
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not f.name.endswith("_per_s"):
                continue
            value = getattr(self, f.name)
            if value is None:
                continue
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{f.name} must be a positive finite number, got {value!r}")
        if not (isinstance(self.host_copy_bytes_per_s, (int, float))):
            raise ConfigError("host_copy_bytes_per_s is required")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping (the on-disk form)."""
        return dataclasses.asdict(self)


# Conservative on purpose: slow links make offload look dearer, so a machine that was never
# measured retains a little more rather than stalling on reloads it cannot afford. Prefill is
# left unknown, which only forbids dropping for speed.
DEFAULT_PROFILE = HardwareProfile(
    host_copy_bytes_per_s=5e9,
    disk_write_bytes_per_s=0.5e9,
    disk_read_bytes_per_s=1e9,
    source="default",
)


def default_profile_path() -> Path:
    """``$AGENTKV_PROFILE`` when set and non-empty, else ``~/.cache/agentkv/profile.json``."""
    env = os.environ.get(PROFILE_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "agentkv" / "profile.json"


def profile_from_dict(data: Any, *, where: str = "profile") -> HardwareProfile:
    """Validate a mapping (parsed JSON) into a HardwareProfile.

    Contract: raises ConfigError naming ``where`` and the bad field; ignores unknown keys.
    """
    from pydantic import TypeAdapter, ValidationError

    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(HardwareProfile)}
    cleaned = {k: v for k, v in data.items() if k in known}
    if isinstance(cleaned.get("machine"), dict):
        machine_known = {f.name for f in dataclasses.fields(MachineInfo)}
        cleaned["machine"] = {k: v for k, v in cleaned["machine"].items() if k in machine_known}
    try:
        return TypeAdapter(HardwareProfile).validate_python(cleaned)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        raise ConfigError(f"{where}: field {loc or '?'}: {first.get('msg')}") from exc
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def load_profile(path: str | os.PathLike[str] | None = None) -> HardwareProfile:
    """Load the hardware profile at ``path`` (default: ``default_profile_path()``).

    Contract: returns DEFAULT_PROFILE (source='default') when the file does not exist; raises
    ConfigError when it exists but is unreadable, not JSON, or fails validation.
    """
    target = Path(path).expanduser() if path is not None else default_profile_path()
    try:
        text = target.read_text(encoding="utf-8")
    except FileNotFoundError:
        return DEFAULT_PROFILE
    except OSError as exc:
        raise ConfigError(f"cannot read profile {target}: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"profile {target} is not valid JSON: {exc}") from exc
    return profile_from_dict(data, where=f"profile {target}")


def save_profile(profile: HardwareProfile, path: str | os.PathLike[str] | None = None) -> Path:
    """Write ``profile`` as JSON to ``path`` (default: ``default_profile_path()``).

    Contract: creates parent directories; replaces the file atomically (a reader sees the old or
    the new profile, never half of one); returns the path written. Raises ConfigError on I/O
    failure.
    """
    target = Path(path).expanduser() if path is not None else default_profile_path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".json", dir=target.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(profile.to_dict(), fh, indent=2, sort_keys=True)
                fh.write("\n")
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise ConfigError(f"cannot write profile {target}: {exc}") from exc
    return target
