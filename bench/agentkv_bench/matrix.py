"""The fixed-policy configuration matrix of ``agentkv bench agents --configs ... --num-blocks ...``.

Primitives:
  BenchConfig          the configurations a bench can run (StrEnum): vanilla, agentkv,
                       retain-always, offload-always, oracle, connector-only
  ConfigSpec           how one configuration runs: which client driver (plain requests or a
                       trajectory), the connector settings it adds, whether it gets the pool
                       under test or the oracle's
  SPECS                BenchConfig -> ConfigSpec (the one definition of each configuration)
  FIXED_POLICIES       the configurations the agentkv policy is judged against (its regret)
  parse_configs(text)  "vanilla,agentkv,..." -> tuple[BenchConfig, ...] (ValueError on bad input)
  parse_num_blocks(text) "96,48,24" -> tuple[int, ...] (ValueError on bad input)
  Cell                 one server run: a configuration at a pool size
  cells(configs, pools) the runs of a sweep, in order: each pool size's configurations, the
                       oracle once (its pool is computed from the workload, not swept)

retain-always and offload-always are real agentkv servers whose connector takes one action at
every pause (``policy_override`` in ``kv_connector_extra_config``); the harness side is the same
trajectory driver as agentkv's, so the three differ only in the pause decision. connector-only
is the other half of a decomposition: agentkv's server with vanilla's client (no trajectory, no
pause), so vanilla -> connector-only -> retain-always -> agentkv splits agentkv's cost into the
connector's, the trajectory calls', and the copies'.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class BenchConfig(StrEnum):
    VANILLA = "vanilla"
    AGENTKV = "agentkv"
    RETAIN_ALWAYS = "retain-always"
    OFFLOAD_ALWAYS = "offload-always"
    ORACLE = "oracle"
    CONNECTOR_ONLY = "connector-only"


class Driver(StrEnum):
    PLAIN = "plain"  # OpenAI requests without agentkv params (vanilla vLLM's view)
    TRAJECTORY = "trajectory"  # trajectory params, pause and resume (agentkv's contract)


@dataclass(frozen=True)
class ConfigSpec:
    config: BenchConfig
    driver: Driver
    connector: bool
    # Extra kv_connector_extra_config keys on top of the bench's (host tier, disk dir).
    connector_settings: dict[str, Any] = field(default_factory=dict)
    oracle_pool: bool = False  # the workload's never-evict pool instead of the swept size

    @property
    def trajectory(self) -> bool:
        return self.driver is Driver.TRAJECTORY


SPECS: dict[BenchConfig, ConfigSpec] = {
    BenchConfig.VANILLA: ConfigSpec(BenchConfig.VANILLA, Driver.PLAIN, connector=False),
    BenchConfig.AGENTKV: ConfigSpec(BenchConfig.AGENTKV, Driver.TRAJECTORY, connector=True),
    BenchConfig.RETAIN_ALWAYS: ConfigSpec(
        BenchConfig.RETAIN_ALWAYS,
        Driver.TRAJECTORY,
        connector=True,
        connector_settings={"policy_override": "retain"},
    ),
    BenchConfig.OFFLOAD_ALWAYS: ConfigSpec(
        BenchConfig.OFFLOAD_ALWAYS,
        Driver.TRAJECTORY,
        connector=True,
        connector_settings={"policy_override": "offload_host"},
    ),
    BenchConfig.ORACLE: ConfigSpec(
        BenchConfig.ORACLE, Driver.PLAIN, connector=False, oracle_pool=True
    ),
    # agentkv loaded, every request plain (no trajectory, no pause): what the connector alone
    # costs on this workload, to tell it from what trajectories cost (a diagnostic, not a policy).
    BenchConfig.CONNECTOR_ONLY: ConfigSpec(
        BenchConfig.CONNECTOR_ONLY, Driver.PLAIN, connector=True
    ),
}

# What a policy has to beat: the fixed ways to run the same pool (vanilla = never pin, never copy).
FIXED_POLICIES: tuple[BenchConfig, ...] = (
    BenchConfig.VANILLA,
    BenchConfig.RETAIN_ALWAYS,
    BenchConfig.OFFLOAD_ALWAYS,
)
DEFAULT_CONFIGS = "vanilla,agentkv"


def parse_configs(text: str) -> tuple[BenchConfig, ...]:
    """Comma-separated names, order kept, duplicates dropped; agentkv must be among them (the
    reports read every other configuration against it)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError("--configs is empty")
    valid = ", ".join(c.value for c in BenchConfig)
    out: list[BenchConfig] = []
    for n in names:
        try:
            c = BenchConfig(n)
        except ValueError:
            raise ValueError(f"unknown configuration {n!r} in --configs (valid: {valid})") from None
        if c not in out:
            out.append(c)
    if BenchConfig.AGENTKV not in out:
        raise ValueError("--configs must include agentkv (every ratio and regret is agentkv's)")
    return tuple(out)


def parse_num_blocks(text: str, minimum: int = 8) -> tuple[int, ...]:
    """Comma-separated pool sizes in blocks, order kept (roomy first reads best), duplicates
    dropped; each an integer >= ``minimum``."""
    out: list[int] = []
    for t in (t.strip() for t in text.split(",")):
        if not t:
            continue
        try:
            n = int(t)
        except ValueError:
            raise ValueError(f"--num-blocks: {t!r} is not an integer") from None
        if n < minimum:
            raise ValueError(f"--num-blocks: {n} is below the minimum of {minimum} blocks")
        if n not in out:
            out.append(n)
    if not out:
        raise ValueError("--num-blocks is empty")
    return tuple(out)


@dataclass(frozen=True)
class Cell:
    config: BenchConfig
    num_blocks: int | None  # None: the oracle's pool (computed from the workload)

    @property
    def spec(self) -> ConfigSpec:
        return SPECS[self.config]

    @property
    def label(self) -> str:
        return self.config.value if self.num_blocks is None else f"{self.config}@{self.num_blocks}"


def cells(configs: Iterable[BenchConfig], pools: Iterable[int]) -> list[Cell]:
    """Every server run of a sweep: per pool size (in the given order) each configuration but
    the oracle, then the oracle once (its pool does not depend on the swept size)."""
    configs = list(configs)
    out = [Cell(c, n) for n in pools for c in configs if not SPECS[c].oracle_pool]
    out += [Cell(c, None) for c in configs if SPECS[c].oracle_pool]
    return out
