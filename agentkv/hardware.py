"""Accelerator memory presets for capacity planning.

Primitives:
    GpuPreset     one accelerator model: its memory in bytes and the convention of its nominal size
    GPU_PRESETS   name -> GpuPreset (H100, H200, B200, A100-80GB, L40S, MI300X)
    get_preset    case- and punctuation-insensitive lookup ('h100', 'H100-80GB', 'mi300x')

A preset is the vendor's nominal capacity, read in the convention the figure really uses: an H100's
"80 GB" is 80 GiB of HBM (8 of them give the reference's 687.2 GB node), whereas a B200's "192 GB"
and an L40S's "48 GB" are decimal. The driver and ECC keep a little of it, so for exact sizing
pass the byte figure ``nvidia-smi --query-gpu=memory.total`` reports instead of a preset.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agentkv.errors import ConfigError
from agentkv.units import BYTE_UNITS


@dataclass(frozen=True)
class GpuPreset:
    """One accelerator model's memory, as its vendor states it."""

    name: str
    memory_bytes: int
    nominal: str
    """The vendor's figure with the unit it really means, e.g. '80 GiB' or '192 GB'."""
    convention: str
    """'GiB' (powers of two) or 'GB' (powers of ten): how ``nominal`` is to be read."""


def _preset(name: str, amount: int, convention: str) -> GpuPreset:
    return GpuPreset(
        name=name,
        memory_bytes=amount * BYTE_UNITS[convention],
        nominal=f"{amount} {convention}",
        convention=convention,
    )


GPU_PRESETS: dict[str, GpuPreset] = {
    p.name: p
    for p in (
        _preset("H100", 80, "GiB"),
        _preset("H200", 141, "GiB"),
        _preset("B200", 192, "GB"),
        _preset("A100-80GB", 80, "GiB"),
        _preset("L40S", 48, "GB"),
        _preset("MI300X", 192, "GiB"),
    )
}

_ALIASES: dict[str, str] = {
    "h100": "H100",
    "h10080gb": "H100",
    "h100sxm": "H100",
    "h200": "H200",
    "h200141gb": "H200",
    "b200": "B200",
    "a100": "A100-80GB",
    "a10080gb": "A100-80GB",
    "l40s": "L40S",
    "mi300x": "MI300X",
}


def get_preset(name: str) -> GpuPreset:
    """Return the preset called ``name`` (case and '-', '_', ' ' ignored).

    Contract: raises ConfigError naming the known presets when there is no such preset.
    """
    key = re.sub(r"[\s_\-]", "", name).lower()
    canonical = _ALIASES.get(key)
    if canonical is None:
        raise ConfigError(
            f"unknown GPU preset {name!r}; known: {', '.join(GPU_PRESETS)} (or give --hbm-bytes)"
        )
    return GPU_PRESETS[canonical]
