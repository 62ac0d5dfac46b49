"""Small domain types parsed once: byte sizes ("96GiB") and CPU lists ("0-7,16-23").

Sizes are bytes internally; humans see GiB/MiB.
"""

from __future__ import annotations

import re
from typing import Iterable

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")

KiB = 1024
MiB = 1024**2
GiB = 1024**3


def parse_size(value: int | float | str) -> int:
    """Parse ``"96GiB"``, ``"512 MiB"``, ``"1.5G"`` (decimal G), or a plain number of bytes.

    Raises ValueError with a message suitable for a config error.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size like '24GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"expected a size like '24GiB' or '512MiB', got {value!r}")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(f"unknown size unit {m.group(2)!r} in {value!r} (use B, KiB, MiB, GiB, TiB, or KB, MB, GB, TB)")
    return int(number * _UNITS[unit])


def fmt_bytes(n: int | float | None, *, precision: int = 1) -> str:
    """Human-readable binary size: ``fmt_bytes(3 * 2**30) == '3.0 GiB'``."""
    if n is None:
        return "?"
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("TiB", 1024**4), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{sign}{n / scale:.{precision}f} {unit}"
    return f"{sign}{int(n)} B"


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Parse a Linux list string (``"0-3,8,10-11"``; also ``"0-15:4"`` strides) into sorted unique ints."""
    out: set[int] = set()
    for item in text.replace(" ", "").replace("\n", "").split(","):
        if not item:
            continue
        rng, _, stride = item.partition(":")
        lo, sep, hi = rng.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (stride and not stride.isdigit()):
            raise ValueError(f"bad CPU/node list {text!r}: expected items like 3 or 0-7 separated by commas")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"bad CPU/node list {text!r}: range {item} goes backwards")
        out.update(range(a, b + 1, int(stride) if stride else 1))
    return tuple(sorted(out))


def format_cpulist(cpus: Iterable[int]) -> str:
    """Inverse of :func:`parse_cpulist`: ``format_cpulist([0,1,2,3,8]) == '0-3,8'``."""
    items = sorted(set(cpus))
    if not items:
        return ""
    ranges: list[str] = []
    start = prev = items[0]
    for c in items[1:]:
        if c == prev + 1:
            prev = c
            continue
        ranges.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = c
    ranges.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(ranges)


def parse_cpumask(text: str) -> tuple[int, ...]:
    """Parse a Linux hex mask (``"00000000,0000ff00"``: 32-bit words, most significant first)."""
    words = [w for w in text.strip().replace("0x", "").split(",") if w != ""]
    if not words:
        return ()
    value = 0
    for w in words:
        value = (value << 32) | int(w, 16)
    out = []
    bit = 0
    while value:
        if value & 1:
            out.append(bit)
        value >>= 1
        bit += 1
    return tuple(out)
