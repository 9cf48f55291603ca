"""Human-readable numbers and plain-text tables for the CLI and reports.

Every number a person reads carries its unit: bytes in binary units (KiB, MiB, GiB, TiB — what allocators and
``nvidia-smi`` report), seconds scaled to ms/µs, FLOPs with SI prefixes. Machine output (``--json``) never goes
through here: it keeps base units (bytes, seconds, FLOPs).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_SI = ("", "k", "M", "G", "T", "P", "E", "Z")


def human_bytes(value: float) -> str:
    """``1536`` -> ``1.50 KiB``; negative values keep their sign."""
    if not math.isfinite(value):
        return str(value)
    sign = "-" if value < 0 else ""
    v = abs(float(value))
    unit = 0
    while v >= 1024 and unit < len(_BINARY) - 1:
        v /= 1024
        unit += 1
    return f"{sign}{v:.0f} B" if unit == 0 else f"{sign}{v:.2f} {_BINARY[unit]}"


def human_seconds(value: float) -> str:
    """``0.0123`` -> ``12.3 ms``; ``75`` -> ``75.0 s``."""
    if not math.isfinite(value):
        return str(value)
    v = abs(value)
    sign = "-" if value < 0 else ""
    if v == 0:
        return "0 s"
    if v >= 1:
        return f"{sign}{v:.2f} s"
    if v >= 1e-3:
        return f"{sign}{v * 1e3:.2f} ms"
    return f"{sign}{v * 1e6:.1f} µs"


def human_si(value: float, unit: str) -> str:
    """``3.2e15, "FLOP"`` -> ``3.20 PFLOP``."""
    if not math.isfinite(value) or value == 0:
        return f"{value:g} {unit}"
    exp = min(max(math.floor(math.log10(abs(value)) / 3), 0), len(_SI) - 1)
    return f"{value / 10 ** (3 * exp):.2f} {_SI[exp]}{unit}"


def human_count(value: float) -> str:
    """``8030261248`` -> ``8.03 B`` (billions), for parameter counts."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            return f"{value / div:.2f} {suffix}"
    return f"{value:.0f}"


def percent(fraction: float) -> str:
    """``0.123`` -> ``12.3 %``."""
    return f"{fraction * 100:.1f} %"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, title: str = "") -> str:
    """A plain-text table: first column left-aligned, the rest right-aligned (they hold numbers)."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = [c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(cells)]
        return "  ".join(parts).rstrip()

    out = [title] if title else []
    out.append(line(headers))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in rows)
    return "\n".join(out)
