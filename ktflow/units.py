"""Byte units, and the two ways ktflow writes a size (one definition of each)."""

from __future__ import annotations

GiB = 1 << 30
GB = 1_000_000_000  # decimal: what disks, downloads and bandwidths are quoted in


def human_bytes(n: float) -> str:
    """``n`` bytes as a short human figure in binary units: ``512 B``, ``5.5 MiB``, ``553.4 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def gib(n: float) -> str:
    """Bytes as a GiB figure without the unit, with decimals where a whole number would read as
    zero (how a preflight words memory: ``needs ~600 GiB``, ``needs ~8.00 GiB``)."""
    return f"{n / GiB:.0f}" if n >= 10 * GiB else f"{n / GiB:.2f}"
