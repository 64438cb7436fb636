"""Human-readable sizes, rates and durations for tables and messages."""

from __future__ import annotations


def fmt_bytes(size_bytes: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units, one decimal."""
    value = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def fmt_rate(size_bytes: float, seconds: float) -> str:
    """Throughput in decimal GB/s, as copy benchmarks usually report it."""
    if seconds <= 0:
        return "inf GB/s"
    return f"{size_bytes / seconds / 1e9:.2f} GB/s"


def fmt_seconds(seconds: float) -> str:
    """``0.0123`` -> ``"12.3 ms"``, ``2.5`` -> ``"2.50 s"``."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"
