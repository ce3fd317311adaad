"""Simulated vs measured: the numbers of a real run and how far the simulator is from them.

Primitives:
  MEASURED_SCHEMA        ``agentkv-simulate-measured/1``: a measured run's setup and, per
                         configuration (vanilla, agentkv), its metrics under the bench's names
  load_measured(path)    -> {"setup": ..., "configs": {name: {metric: value}}, "source": ...};
                         reads that schema or an ``agentkv bench agents`` / trace-bench report
                         (``configs.<name>.summary``)
  Row                    one metric of one configuration (or a ratio): simulated, measured,
                         relative error, within tolerance
  compare(simulated, measured, keys, tolerance) -> [Row]  every key per configuration, then
                         the agentkv / vanilla ratio of every key when both are present
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agentkv.errors import ConfigError
from agentkv.simulate.metrics import COMPARED

MEASURED_SCHEMA = "agentkv-simulate-measured/1"


def load_measured(path: str | Path) -> dict[str, Any]:
    """A measured run: this module's fixture schema or a bench report with ``configs``."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read measured run {path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("configs"), dict):
        raise ConfigError(f"{path}: no 'configs' object (not a measured run or bench report)")
    if data.get("schema") == MEASURED_SCHEMA:
        return data
    configs = {
        name: dict(c.get("summary") or {})
        for name, c in data["configs"].items()
        if isinstance(c, dict)
    }
    return {
        "schema": data.get("schema"),
        "source": str(path),
        "setup": {"server": data.get("server"), "workload": data.get("workload")},
        "configs": configs,
    }


@dataclass(frozen=True)
class Row:
    config: str
    metric: str
    simulated: float | None
    measured: float | None
    rel_error: float | None
    within: bool | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _row(config: str, metric: str, sim: Any, meas: Any, tolerance: float) -> Row:
    if not isinstance(sim, (int, float)) or not isinstance(meas, (int, float)) or not meas:
        return Row(config, metric, sim, meas, None, None)
    err = (float(sim) - float(meas)) / abs(float(meas))
    return Row(config, metric, float(sim), float(meas), err, abs(err) <= tolerance)


def compare(
    simulated: Mapping[str, Mapping[str, Any]],
    measured: Mapping[str, Mapping[str, Any]],
    keys: Iterable[str] = COMPARED,
    tolerance: float = 0.25,
) -> list[Row]:
    """Rows for every ``key`` of every configuration present on both sides, then the
    agentkv / vanilla ratios of the same keys."""
    keys = tuple(keys)
    rows: list[Row] = []
    for name in ("vanilla", "agentkv"):
        if name in simulated and name in measured:
            rows.extend(
                _row(name, k, simulated[name].get(k), measured[name].get(k), tolerance)
                for k in keys
            )
    if all(n in simulated and n in measured for n in ("vanilla", "agentkv")):
        for k in keys:
            sa, sv = simulated["agentkv"].get(k), simulated["vanilla"].get(k)
            ma, mv = measured["agentkv"].get(k), measured["vanilla"].get(k)
            s_ratio = sa / sv if isinstance(sa, (int, float)) and sv else None
            m_ratio = ma / mv if isinstance(ma, (int, float)) and mv else None
            rows.append(_row("agentkv/vanilla", k, s_ratio, m_ratio, tolerance))
    return rows
