"""``spswap bench traffic``'s pure parts: the Poisson arrivals, the per-rate summary and
its table (no processes, no clock)."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Arrival:
    at_s: float  # from the start of the rate's run
    model: int  # index into the models
    prompt_ids: tuple[int, ...]


def arrivals(rate_per_min: float, duration_s: float, n_models: int, *, seed: int = 0,
             vocab: int = 64, prompt_len: int = 4) -> list[Arrival]:  # fmt: skip
    """A Poisson process of ``rate_per_min`` over ``duration_s``, each request for a model
    drawn uniformly, with a random prompt of ``prompt_len`` ids below ``vocab``."""
    rng = random.Random(f"{seed}-{rate_per_min}-{n_models}")
    out: list[Arrival] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate_per_min / 60.0)
        if t >= duration_s:
            return out
        out.append(
            Arrival(
                t,
                rng.randrange(n_models),
                tuple(rng.randrange(1, vocab) for _ in range(prompt_len)),
            )
        )


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q``-th percentile (0 < q <= 100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


@dataclass(frozen=True)
class RateRow:
    """One rate's result."""

    n_models: int
    rate_per_min: float
    requests: int
    failed: int
    wrong: int  # answers that differ from the model's cold answer (when checked)
    p50_s: float | None
    p95_s: float | None
    p99_s: float | None
    swaps: int
    swap_p50_s: float | None
    swap_p95_s: float | None
    per_device_hour: float  # answered requests per device-hour, all models on one device
    dedicated_per_device_hour: float  # the same answers with one device per model

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(n_models: int, rate_per_min: float, latencies_s: list[float], failed: int,
              wrong: int, swap_s: list[float], duration_s: float) -> RateRow:  # fmt: skip
    """The row for one rate: latency percentiles of the answered requests, swaps, and
    throughput per device-hour (shared device vs one device per model)."""
    hours = duration_s / 3600.0
    answered = len(latencies_s)
    return RateRow(
        n_models=n_models, rate_per_min=rate_per_min, requests=answered + failed,
        failed=failed, wrong=wrong, p50_s=percentile(latencies_s, 50),
        p95_s=percentile(latencies_s, 95), p99_s=percentile(latencies_s, 99),
        swaps=len(swap_s), swap_p50_s=percentile(swap_s, 50), swap_p95_s=percentile(swap_s, 95),
        per_device_hour=answered / hours, dedicated_per_device_hour=answered / hours / n_models,
    )  # fmt: skip


def highest_within(rows: list[RateRow], p95_target_s: float) -> dict[int, float | None]:
    """Per model count, the highest rate whose p95 met the target with nothing failed."""
    best: dict[int, float | None] = {}
    for row in rows:
        best.setdefault(row.n_models, None)
        ok = row.failed == 0 and row.p95_s is not None and row.p95_s <= p95_target_s
        if ok and (best[row.n_models] is None or row.rate_per_min > (best[row.n_models] or 0)):
            best[row.n_models] = row.rate_per_min
    return best


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def render(rows: list[RateRow], p95_target_s: float) -> str:
    """The table ``spswap bench traffic`` prints."""
    head = (
        "models  rate/min  requests  failed  wrong  p50_s  p95_s  p99_s  swaps  "
        "swap_p50_s  req/device-h  dedicated"
    )
    lines = [head]
    for r in rows:
        lines.append(f"{r.n_models:>6}  {r.rate_per_min:>8g}  {r.requests:>8}  {r.failed:>6}  "
                     f"{r.wrong:>5}  {_s(r.p50_s):>5}  {_s(r.p95_s):>5}  {_s(r.p99_s):>5}  "
                     f"{r.swaps:>5}  {_s(r.swap_p50_s):>10}  {r.per_device_hour:>12.0f}  "
                     f"{r.dedicated_per_device_hour:>9.0f}")  # fmt: skip
    for n, rate in highest_within(rows, p95_target_s).items():
        lines.append(f"{n} models: highest rate within p95 <= {p95_target_s:g} s: "
                     f"{'none' if rate is None else f'{rate:g}/min'}")  # fmt: skip
    return "\n".join(lines) + "\n"
