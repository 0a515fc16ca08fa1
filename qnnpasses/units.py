"""One way to write sizes and amounts of work, for every command, report and picture.

Bytes use binary units with one decimal (``418.6 KiB``, ``1.2 GiB``; below 1 KiB the exact
count, ``912 B``); FLOPs and other counts use SI prefixes with one decimal (``3.1 MFLOPs``).
Sizes the user types (``2G``, ``512MiB``) are read by :func:`parse_size`.
"""

from __future__ import annotations

import re

from qnnpasses.errors import BadInputError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

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


def parse_size(text: str, option: str = "--max-part-bytes") -> int:
    """``2G``, ``512MiB``, ``1.5g``, ``6000000`` -> bytes (binary units); ``option`` names the flag
    in the error."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise BadInputError(f"{option} expects a size such as 2G, 512M or 6000000 (got '{text}')")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
