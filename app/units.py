"""Byte sizes as people write them ("4GiB", "512MiB", "1.5GB") and as we print them."""

from __future__ import annotations

import re
from decimal import Decimal

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

SIZE_HELP = 'a size with a unit such as "4GiB", "512MiB" or "2GB" (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)'
MAX_SIZE = 1 << 50  # 1 PiB: past any machine, and keeps arithmetic exact


def parse_size(text: str) -> int:
    """Parse "4GiB" / "1.5 GB" / "1024" into bytes; raise ValueError naming what is allowed."""
    match = _SIZE.match(text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS or len(match.group(1)) > 20:
        raise ValueError(f"{text!r} is not {SIZE_HELP}")
    size = int(Decimal(match.group(1)) * _UNITS[unit])
    if size > MAX_SIZE:
        raise ValueError(f"{text!r} is larger than 1 PiB")
    return size


def has_unit(text: str) -> bool:
    match = _SIZE.match(text)
    return bool(match and match.group(2))


def exact_size(num_bytes: int) -> str:
    """The shortest exact spelling: 4294967296 -> "4GiB", 1000001 -> "1000001B"; parse_size reads it back."""
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024),
                         ("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("KB", 1000)):
        if num_bytes >= factor and num_bytes % factor == 0:
            return f"{num_bytes // factor}{unit}"
    return f"{num_bytes}B"


def format_size(num_bytes: int | float) -> str:
    """Binary units with two significant decimals: 1536 MiB -> "1.50 GiB"."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
