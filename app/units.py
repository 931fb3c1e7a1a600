"""Byte sizes as people write them ("4GiB", "512MiB", "1.5GB") and as we print them."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

SIZE_HELP = 'a size with a unit such as "4GiB", "512MiB" or "2GB" (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)'


def parse_size(text: str) -> int:
    """Parse "4GiB" / "1.5 GB" / "1024" into bytes; raise ValueError naming what is allowed."""
    match = _SIZE.match(text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise ValueError(f"{text!r} is not {SIZE_HELP}")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(num_bytes: int | float) -> str:
    """Binary units with two significant decimals: 1536 MiB -> "1.50 GiB"."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
