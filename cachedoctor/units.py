"""Numbers as people read them."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """1,234,567 -> '1.2 MB' (decimal units, as file managers and `du -h --si` show)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def age(seconds: float) -> str:
    """A duration as its largest sensible unit: '42 s', '7 min', '3 h', '12 days'."""
    for limit, unit, size in ((120, "s", 1), (7200, "min", 60), (172800, "h", 3600)):
        if seconds < limit:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds / 86400:.0f} days"


def count(n: int, noun: str, plural: str | None = None) -> str:
    """count(1, 'file') -> '1 file'; count(3, 'file') -> '3 files'."""
    return f"{n:,} {noun if n == 1 else (plural or noun + 's')}"


def shape_text(shape: tuple[int, ...] | None) -> str:
    """(4, 64, 64) -> '[4, 64, 64]'."""
    return "[?]" if shape is None else "[" + ", ".join(map(str, shape)) + "]"
