"""``spswap bench slots``: how long an uncontended reserve + release takes."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from spswap.slots.table import SlotTable

TARGET_P50_MS = 1.0
"""The slot table's budget: a reserve + release pair, uncontended, at the median."""


def _percentile(sorted_ms: list[float], q: float) -> float:
    index = min(len(sorted_ms) - 1, max(0, round(q * (len(sorted_ms) - 1))))
    return sorted_ms[index]


def bench_slots(slots_dir: Path, *, iterations: int = 2000, units: int = 1) -> dict[str, Any]:
    """Time ``iterations`` reserve + release pairs on a table in ``slots_dir``.

    ``slots_dir`` should be a fresh directory on the same file system as the real table
    (tmpfs): the cost is the lock, one state read and one atomic, fsync'ed write per call.
    """
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    table = SlotTable(slots_dir, [0], poll_interval_s=0.001)
    # One warm-up pair: creates the lock and state files and imports lazily loaded code.
    table.release(table.reserve(model="bench", units=units, timeout_s=5.0).id)
    pairs_ms: list[float] = []
    reserve_ms: list[float] = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        r = table.reserve(model="bench", units=units, timeout_s=5.0)
        t1 = time.perf_counter()
        table.release(r.id)
        t2 = time.perf_counter()
        reserve_ms.append((t1 - t0) * 1e3)
        pairs_ms.append((t2 - t0) * 1e3)
    pairs_ms.sort()
    reserve_ms.sort()
    p50 = _percentile(pairs_ms, 0.5)
    return {
        "slots_dir": str(slots_dir), "iterations": iterations, "units": units,
        "p50_ms": p50, "p90_ms": _percentile(pairs_ms, 0.9),
        "p99_ms": _percentile(pairs_ms, 0.99), "max_ms": pairs_ms[-1],
        "mean_ms": statistics.fmean(pairs_ms), "reserve_p50_ms": _percentile(reserve_ms, 0.5),
        "target_p50_ms": TARGET_P50_MS, "meets_target": p50 <= TARGET_P50_MS,
    }  # fmt: skip


def render_bench_slots(result: dict[str, Any]) -> Table:
    """A rich table of :func:`bench_slots`'s result."""
    verdict = "[green]meets[/]" if result["meets_target"] else "[red]misses[/]"
    table = Table(
        title=f"slot reserve + release, uncontended ({result['iterations']} pairs, "
        f"{result['slots_dir']})",
        caption=f"{verdict} the p50 <= {result['target_p50_ms']:g} ms target",
    )
    for col in ("p50", "p90", "p99", "max", "mean", "reserve alone p50"):
        table.add_column(col, justify="right")
    keys = ("p50_ms", "p90_ms", "p99_ms", "max_ms", "mean_ms", "reserve_p50_ms")
    table.add_row(*(f"{result[k]:.3f} ms" for k in keys))
    return table
