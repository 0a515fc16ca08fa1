"""One way to write sizes and amounts of work, for every command, report and picture.

Bytes use binary units with one decimal (``418.6 KiB``, ``1.2 GiB``; below 1 KiB the exact
count, ``912 B``); FLOPs and other counts use SI prefixes with one decimal (``3.1 MFLOPs``).
"""

from __future__ import annotations

_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_SI = ("", "k", "M", "G", "T", "P")


def fmt_bytes(n: float | None) -> str:
    """``428700`` -> ``418.7 KiB``; ``None`` -> ``-``."""
    if n is None:
        return "-"
    value = float(n)
    if abs(value) < 1024:
        return f"{value:.0f} B"
    for unit in _BINARY[1:]:
        value /= 1024.0
        if abs(value) < 1024 or unit == _BINARY[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def _si(value: float) -> tuple[str, str]:
    if abs(value) < 1000:
        return (f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"), ""
    for prefix in _SI[1:]:
        value /= 1000.0
        if abs(value) < 1000 or prefix == _SI[-1]:
            return f"{value:.1f}", prefix
    raise AssertionError("unreachable")


def fmt_count(n: float | None, unit: str = "") -> str:
    """``3090000`` -> ``3.1 M`` (with ``unit``: ``3.1 MFLOPs``)."""
    if n is None:
        return "-"
    number, prefix = _si(float(n))
    return f"{number} {prefix}{unit}".rstrip()


def fmt_flops(n: float | None) -> str:
    """``3090000`` -> ``3.1 MFLOPs``."""
    return fmt_count(n, "FLOPs")


def fmt_seconds(s: float | None) -> str:
    """``0.0123`` -> ``12 ms``; ``4.26`` -> ``4.3 s``; ``None`` -> ``-``."""
    if s is None:
        return "-"
    if s < 1:
        return f"{s * 1000:.0f} ms"
    return f"{s:.1f} s"


__all__ = ["fmt_bytes", "fmt_count", "fmt_flops", "fmt_seconds"]
