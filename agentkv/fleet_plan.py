"""What ``agentkv fleet up`` starts on this machine when the user gave no sizes: replicas, KV
space and devices per replica, and where its logs go. Pure functions plus small probes.

Primitives:
  state_dir(env) -> Path            per-user state: $AGENTKV_STATE_DIR, else
                                    $XDG_STATE_HOME/agentkv, else ~/.local/state/agentkv
  detect_gpus(env, run) -> [id]     CUDA devices: CUDA_VISIBLE_DEVICES when set, else
                                    ``nvidia-smi -L``; [] on a CPU machine
  available_memory_gib(path)        MemAvailable from /proc/meminfo
  model_gib(path)                   weight files' size of a local model folder (0 for a hub id)
  plan_fleet(...) -> FleetPlan      replicas, each one's KV GiB (CPU) or device group (CUDA), and
                                    the sentence that says what was chosen and why

The CPU rule: vLLM's CPU backend allocates its KV cache up front (``VLLM_CPU_KVCACHE_SPACE``)
and, without it, tries to reserve ``--gpu-memory-utilization`` (0.92) of the node's memory, so N
replicas on one host need an explicit share each: ``floor((0.8 x available - N x (weights +
RESERVE_GIB)) / N)`` GiB, at least 1 (else the plan is refused with the numbers). The CUDA rule:
one replica per ``gpus_per_replica`` devices (``CUDA_VISIBLE_DEVICES`` per replica, tensor
parallel inside a replica); by default as many replicas as the devices allow.
"""

from __future__ import annotations

import math
import os
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from agentkv.errors import ConfigError

CPU_DEFAULT_REPLICAS = 2
RESERVE_GIB = 3.0  # per replica on CPU: API server + engine core + worker, beyond weights and KV
USABLE_FRACTION = 0.8  # of MemAvailable (the rest: the router, Valkey, page cache, headroom)
GIB = 1024**3
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("AGENTKV_STATE_DIR"):
        return Path(env["AGENTKV_STATE_DIR"])
    base = env.get("XDG_STATE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".local/state")
    return Path(base) / "agentkv"


def detect_gpus(
    env: Mapping[str, str] | None = None,
    run: Callable[[list[str]], str | None] | None = None,
) -> list[str]:
    """The CUDA device ids this process may use ([] on a CPU machine)."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
        # "-1" (or any negative id) hides every device from CUDA
        return [] if any(d.startswith("-") for d in ids) else ids
    out = (run or _run)(["nvidia-smi", "-L"])
    if not out:
        return []
    return [str(i) for i, line in enumerate(ln for ln in out.splitlines() if ln.startswith("GPU "))]


def _run(argv: list[str]) -> str | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def available_memory_gib(path: str = "/proc/meminfo") -> float:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GIB
    except (OSError, ValueError, IndexError):
        pass
    raise ConfigError(f"cannot read MemAvailable from {path}: pass --kv-space-gib")


def model_gib(model: str) -> float:
    folder = Path(model)
    if not folder.is_dir():
        return 0.0
    return sum(f.stat().st_size for f in folder.iterdir() if f.name.endswith(WEIGHT_SUFFIXES)) / GIB


@dataclass
class FleetPlan:
    replicas: int
    kv_space_gib: int | None = None  # CPU: each replica's KV cache
    device_groups: list[list[str]] = field(default_factory=list)  # CUDA: each replica's devices
    note: str = ""


def plan_fleet(
    *,
    replicas: int | None,
    kv_space_gib: int | None,
    gpus_per_replica: int = 1,
    gpus: list[str],
    available_gib: Callable[[], float],
    weights_gib: float = 0.0,
) -> FleetPlan:
    """Fill in what the user left out (see the module docstring). Raises ConfigError when the
    request cannot fit, with the numbers."""
    if gpus_per_replica < 1:
        raise ConfigError(f"--gpus-per-replica must be at least 1 (got {gpus_per_replica})")
    if gpus:
        fit = len(gpus) // gpus_per_replica
        n = fit if replicas is None else replicas
        if n < 1 or n * gpus_per_replica > len(gpus):
            raise ConfigError(
                f"{n} replica(s) x {gpus_per_replica} GPU(s) do not fit on {len(gpus)} visible "
                f"GPU(s) ({','.join(gpus)}); use --replicas {max(fit, 1)} or fewer GPUs each"
            )
        groups = [gpus[i * gpus_per_replica : (i + 1) * gpus_per_replica] for i in range(n)]
        shown = "; ".join(
            f"replica {i}: CUDA_VISIBLE_DEVICES={','.join(g)}" for i, g in enumerate(groups)
        )
        return FleetPlan(n, kv_space_gib, groups, f"CUDA: {n} replica(s) ({shown})")
    n = CPU_DEFAULT_REPLICAS if replicas is None else replicas
    if kv_space_gib is not None:
        return FleetPlan(
            n, kv_space_gib, [], f"CPU: {n} replicas, --kv-space-gib {kv_space_gib} each"
        )
    avail = available_gib()
    share = (USABLE_FRACTION * avail - n * (weights_gib + RESERVE_GIB)) / n
    kv = math.floor(share)
    if kv < 1:
        raise ConfigError(
            f"{n} CPU replicas do not fit in {avail:.1f} GiB available memory (each needs "
            f"~{weights_gib + RESERVE_GIB:.1f} GiB besides >= 1 GiB of KV cache); use fewer "
            "--replicas or free memory"
        )
    note = (
        f"CPU: {avail:.1f} GiB available, {n} replicas -> --kv-space-gib {kv} each "
        f"({USABLE_FRACTION:.0%} of available, less {weights_gib + RESERVE_GIB:.1f} GiB per "
        "replica for the processes and weights; pass --kv-space-gib to choose)"
    )
    return FleetPlan(n, kv, [], note)
