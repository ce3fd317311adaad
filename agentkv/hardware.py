"""Accelerator memory presets for capacity planning.

Primitives:
    GpuPreset     one accelerator model: its memory in bytes and the convention of its nominal size;
                  for the simulator's presets also its HBM bandwidth, dense BF16 peak and host
                  link (None where no figure is recorded); ``source`` names the datasheet
    GPU_PRESETS   name -> GpuPreset (H100, H200, B200, A100-80GB, L40S, MI300X)
    get_preset    case- and punctuation-insensitive lookup ('h100', 'H100-80GB', 'mi300x')
    NVME_GEN4     one datacenter NVMe drive's sequential rates (the simulator's disk tier)

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
    hbm_bytes_per_s: float | None = None
    bf16_dense_flops_per_s: float | None = None
    """Dense (no sparsity) BF16 tensor-core peak."""
    host_link_bytes_per_s: float | None = None
    """Host <-> device, one direction (PCIe Gen5 x16: 64 GB/s each way, 128 GB/s both)."""
    source: str = ""


def _preset(name: str, amount: int, convention: str, **rates: object) -> GpuPreset:
    return GpuPreset(
        name=name,
        memory_bytes=amount * BYTE_UNITS[convention],
        nominal=f"{amount} {convention}",
        convention=convention,
        **rates,  # type: ignore[arg-type]
    )


@dataclass(frozen=True)
class DiskSpec:
    """One drive's sequential rates, as its vendor states them."""

    name: str
    read_bytes_per_s: float
    write_bytes_per_s: float
    source: str


NVME_GEN4 = DiskSpec(
    "Samsung PM9A3 (PCIe Gen4 U.2, 3.84 TB)",
    6.9e9,
    4.1e9,
    "Samsung PM9A3 datasheet: 6,900 MB/s sequential read, 4,100 MB/s sequential write",
)


GPU_PRESETS: dict[str, GpuPreset] = {
    p.name: p
    for p in (
        _preset(
            "H100",
            80,
            "GiB",
            hbm_bytes_per_s=3.35e12,
            bf16_dense_flops_per_s=989e12,
            host_link_bytes_per_s=64e9,
            source="NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3, 3.35 TB/s, "
            "BF16 1,979 TFLOPS with sparsity (989 dense), PCIe Gen5 128 GB/s",
        ),
        _preset(
            "H200",
            141,
            "GiB",
            hbm_bytes_per_s=4.8e12,
            bf16_dense_flops_per_s=989e12,
            host_link_bytes_per_s=64e9,
            source="NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, "
            "BF16 1,979 TFLOPS with sparsity (989 dense), PCIe Gen5 128 GB/s",
        ),
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
