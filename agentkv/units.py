"""Byte sizes as people write them, and back.

Primitives:
    BYTE_UNITS     unit name -> bytes, decimal (kB, MB, GB, TB, PB) and binary (KiB ... PiB)
    parse_bytes    '526e9', '480GiB', '60 GB', '1.5TiB', '4096' -> int bytes
    format_bytes   int bytes -> '480.00 GiB' in the unit asked for (or 'auto')

Decimal units (GB = 10**9) and binary units (GiB = 2**30) are never mixed up: a bare 'G' or 'Gi'
is rejected rather than guessed, because the two differ by 7% at this scale.
"""

from __future__ import annotations

import math
import re

from agentkv.errors import ConfigError

BYTE_UNITS: dict[str, int] = {
    "B": 1,
    "kB": 10**3,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "PB": 10**15,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "PiB": 2**50,
}

# Lower-case lookup, so 'gib' and 'GIB' work; 'kb' means decimal kilobytes like 'KB'.
_UNITS_CASEFOLD: dict[str, int] = {name.lower(): size for name, size in BYTE_UNITS.items()}

_SIZE_RE = re.compile(r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*$")

_BINARY_AUTO = ("PiB", "TiB", "GiB", "MiB", "KiB")


def parse_bytes(text: str) -> int:
    """Parse a byte size such as '526e9', '480GiB', '60GB' or '4096' into whole bytes.

    Contract: returns a non-negative int (fractions of a byte round to the nearest byte).
    Raises ConfigError for empty text, negative, non-finite or unparsable values, and for unit
    names that don't say whether they are decimal or binary ('G', 'Gi').
    """
    match = _SIZE_RE.match(text)
    if match is None:
        raise ConfigError(f"cannot read {text!r} as a byte size; write e.g. 526e9, 480GiB or 60GB")
    number_text, unit_text = match.groups()
    try:
        number = float(number_text)
    except ValueError as exc:  # the regex admits only numbers, kept for safety
        raise ConfigError(f"cannot read {text!r} as a byte size") from exc
    if not math.isfinite(number):
        raise ConfigError(f"byte size {text!r} is not a finite number")
    if number < 0:
        raise ConfigError(f"byte size {text!r} is negative")
    multiplier = 1
    if unit_text:
        found = _UNITS_CASEFOLD.get(unit_text.lower())
        if found is None:
            raise ConfigError(
                f"unknown byte unit {unit_text!r} in {text!r}; use B, KB/MB/GB/TB (powers of 10) "
                "or KiB/MiB/GiB/TiB (powers of 2)"
            )
        multiplier = found
    value = number * multiplier
    if not math.isfinite(value):
        raise ConfigError(f"byte size {text!r} is too large")
    return round(value)


def format_bytes(n: int, unit: str = "GiB", *, digits: int = 2) -> str:
    """Format ``n`` bytes in ``unit`` ('GiB', 'GB', 'MiB', 'B', ...; 'auto' picks a binary unit).

    Contract: the result always names its unit, e.g. '480.00 GiB' or '526.00 GB', so a reader
    never has to guess the convention. Raises ConfigError for an unknown unit.
    """
    if unit == "auto":
        unit = next((u for u in _BINARY_AUTO if abs(n) >= BYTE_UNITS[u]), "B")
    size = BYTE_UNITS.get(unit)
    if size is None:
        raise ConfigError(f"unknown byte unit {unit!r}; known: {', '.join(BYTE_UNITS)}")
    if size == 1:
        return f"{n:,} B"
    return f"{n / size:,.{digits}f} {unit}"
