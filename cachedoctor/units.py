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


def digits(n: int) -> int:
    """How many decimal digits `n` has, without str(n): past 4,300 digits Python refuses that
    conversion (sys.set_int_max_str_digits), and a hostile header can hold such a number."""
    bits = abs(n).bit_length()
    if bits <= 64:
        return len(str(abs(n)))
    estimate = int(bits * 0.30102999566398120) + 1  # log10(2): exact or one too many
    return estimate - 1 if abs(n) < 10 ** (estimate - 1) else estimate


BIG_DIGITS = 30  # a number with more digits than this is shown by its length


def number(n: int) -> str:
    """An integer as text, bounded: 12345 -> '12345', a 4,000-digit one -> 'a 4,000-digit number'."""
    size = digits(n)
    if size <= BIG_DIGITS:
        return str(n)
    return f"a {'negative ' if n < 0 else ''}{size:,}-digit number"


def listing(items: list | tuple, limit: int = 10) -> str:
    """Items as 'a, b, c', at most `limit` of them: 'a, b, c (and 812 more)'."""
    shown = ", ".join(map(str, items[:limit]))
    return shown if len(items) <= limit else f"{shown} (and {len(items) - limit:,} more)"
