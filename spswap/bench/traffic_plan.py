"""``spswap bench traffic``'s pure parts: the Poisson arrivals, the per-rate summary and
its table (no processes, no clock)."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

from spswap.errors import ConfigError


@dataclass(frozen=True)
class Arrival:
    at_s: float  # from the start of the rate's run
    model: int  # index into the models
    prompt_ids: tuple[int, ...]


def prompt_set(count: int, *, seed: int = 0, vocab: int = 64,
               prompt_len: int = 4) -> list[tuple[int, ...]]:  # fmt: skip
    """``count`` fixed prompts (token ids from 1 below ``vocab``): a vLLM run asks only
    these, so each model's cold answers are made once, at its first start."""
    rng = random.Random(f"prompts-{seed}")
    return [tuple(rng.randrange(1, vocab) for _ in range(prompt_len)) for _ in range(count)]


def parse_rates(text: str) -> tuple[tuple[float, ...], dict[int, tuple[float, ...]]]:
    """``--rates``: ``30,60`` (every model count) and ``4:64,6:48`` (a rate for one model
    count) mixed; returns the rates for every count and those per count."""
    every: list[float] = []
    per: dict[int, list[float]] = {}
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        count, _, rate = item.rpartition(":")
        try:
            value = float(rate)
            n = int(count) if count else None
        except ValueError:
            raise ConfigError(f"--rates {text!r}: {item!r} is neither a rate per minute (60) "
                              "nor MODELS:RATE (4:64)") from None  # fmt: skip
        if value <= 0 or (n is not None and n < 1):
            raise ConfigError(f"--rates {text!r}: {item!r}: rates and model counts are "
                              "positive")  # fmt: skip
        (every if n is None else per.setdefault(n, [])).append(value)
    if not every and not per:
        raise ConfigError("--rates needs at least one rate per minute, e.g. 30,60 or 4:64,6:48")
    return tuple(every), {n: tuple(r) for n, r in per.items()}


def check_rates(counts: tuple[int, ...], every: tuple[float, ...],
                per: dict[int, tuple[float, ...]]) -> None:  # fmt: skip
    """Refuse a model count that --rates gives no rate (it would run nothing)."""
    missing = [n for n in counts if not every and not per.get(n)]
    if missing:
        raise ConfigError(f"--rates gives no rate for {', '.join(map(str, missing))} models: "
                          "add one (e.g. 30 for every model count, or "
                          f"{missing[0]}:30 for that one)")  # fmt: skip


def arrivals(rate_per_min: float, duration_s: float, n_models: int, *, seed: int = 0,
             vocab: int = 64, prompt_len: int = 4,
             prompts: list[tuple[int, ...]] | None = None) -> list[Arrival]:  # fmt: skip
    """A Poisson process of ``rate_per_min`` over ``duration_s``, each request for a model
    drawn uniformly, with a random prompt of ``prompt_len`` ids below ``vocab`` (or one
    of ``prompts``)."""
    rng = random.Random(f"{seed}-{rate_per_min}-{n_models}")
    out: list[Arrival] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate_per_min / 60.0)
        if t >= duration_s:
            return out
        model = rng.randrange(n_models)
        if prompts:
            prompt = prompts[rng.randrange(len(prompts))]
        else:
            prompt = tuple(rng.randrange(1, vocab) for _ in range(prompt_len))
        out.append(Arrival(t, model, prompt))


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

    models: int  # how many models the run served
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
    awake: int = 0  # models awake at once (0: as the units allow)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """The row as one log line, as the table says it."""

        def s(v: float | None) -> str:
            return "-" if v is None else f"{v:.3f} s"

        awake = f"{self.awake} awake" if self.awake else "as many awake as fit"
        return (f"{self.models} models, {awake}, {self.rate_per_min:g}/min: "
                f"{self.requests} requests, {self.failed} failed, {self.wrong} wrong, p50 "
                f"{s(self.p50_s)}, p95 {s(self.p95_s)}, p99 {s(self.p99_s)}; {self.swaps} "
                f"swap{'' if self.swaps == 1 else 's'}, "
                f"p50 {s(self.swap_p50_s)}, p95 {s(self.swap_p95_s)}")  # fmt: skip


def summarize(n_models: int, rate_per_min: float, latencies_s: list[float], failed: int,
              wrong: int, swap_s: list[float], duration_s: float,
              awake: int = 0) -> RateRow:  # fmt: skip
    """The row for one rate: latency percentiles of the answered requests, swaps, and
    throughput per device-hour (shared device vs one device per model)."""
    hours = duration_s / 3600.0
    answered = len(latencies_s)
    return RateRow(
        models=n_models, rate_per_min=rate_per_min, requests=answered + failed,
        failed=failed, wrong=wrong, p50_s=percentile(latencies_s, 50),
        p95_s=percentile(latencies_s, 95), p99_s=percentile(latencies_s, 99),
        swaps=len(swap_s), swap_p50_s=percentile(swap_s, 50), swap_p95_s=percentile(swap_s, 95),
        per_device_hour=answered / hours, dedicated_per_device_hour=answered / hours / n_models,
        awake=awake,
    )  # fmt: skip


def highest_within(rows: list[RateRow], p95_target_s: float) -> list[dict[str, Any]]:
    """Per model count and awake models (None: as many as fit), in the rows' order, the
    highest rate per minute whose p95 met the target with nothing failed (None: no rate
    did): ``{"models", "awake", "rate_per_min"}``, fields a script can read."""
    best: dict[tuple[int, int | None], float | None] = {}
    for row in rows:
        key = (row.models, row.awake or None)
        best.setdefault(key, None)
        ok = row.failed == 0 and row.p95_s is not None and row.p95_s <= p95_target_s
        if ok and (best[key] is None or row.rate_per_min > (best[key] or 0)):
            best[key] = row.rate_per_min
    return [{"models": n, "awake": awake, "rate_per_min": rate}
            for (n, awake), rate in best.items()]  # fmt: skip


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def render(rows: list[RateRow], p95_target_s: float) -> str:
    """The tables ``spswap bench traffic`` prints: the requests' latencies, then the swaps
    and the throughput, each row keyed by its models, awake models and rate; two tables
    so that each fits 80 columns (what a pipe or a log gets)."""
    key_head = "models  awake  rate/min"

    def row_key(r: RateRow) -> str:
        return f"{r.models:>6}  {r.awake or '-':>5}  {r.rate_per_min:>8g}"

    lines = [f"requests (seconds)\n{key_head}  requests  failed  wrong  p50_s  p95_s  p99_s"]
    lines += [f"{row_key(r)}  {r.requests:>8}  {r.failed:>6}  {r.wrong:>5}  {_s(r.p50_s):>5}  "
              f"{_s(r.p95_s):>5}  {_s(r.p99_s):>5}" for r in rows]  # fmt: skip
    lines.append("swaps (seconds); requests per device-hour, shared and one device per model\n"
                 f"{key_head}  swaps  swap_p50_s  swap_p95_s  shared/h  dedicated/h")  # fmt: skip
    lines += [f"{row_key(r)}  {r.swaps:>5}  {_s(r.swap_p50_s):>10}  {_s(r.swap_p95_s):>10}  "
              f"{r.per_device_hour:>8.0f}  {r.dedicated_per_device_hour:>11.0f}"
              for r in rows]  # fmt: skip
    for best in highest_within(rows, p95_target_s):
        key = f"{best['models']} models" + (f", {best['awake']} awake" if best["awake"] else "")
        rate = best["rate_per_min"]
        lines.append(f"{key}: highest rate within p95 <= {p95_target_s:g} s: "
                     f"{'none' if rate is None else f'{rate:g}/min'}")  # fmt: skip
    return "\n".join(lines) + "\n"
