"""The multi-model job's metrics: plain data (:class:`Histogram`, :class:`ModelMetrics`)
and one pure renderer of Prometheus' text format (:func:`render`), tested on its exact
output and with prometheus_client's parser."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PREFIX = "spswap_multi"


@dataclass
class Histogram:
    """Counts of observations per upper bound (cumulative at render time), their sum."""

    bounds_s: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    sum_s: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds_s) + 1)  # the last: above every bound

    def observe(self, value_s: float) -> None:
        self.counts[bisect.bisect_left(self.bounds_s, value_s)] += 1
        self.sum_s += value_s
        self.count += 1


@dataclass
class ModelMetrics:
    """What the router counts for one model."""

    requests: dict[str, int] = field(default_factory=dict)  # outcome -> count
    ttft_s: Histogram = field(default_factory=Histogram)
    latency_s: Histogram = field(default_factory=Histogram)
    wake_s: Histogram = field(default_factory=Histogram)  # swap latency: sleeps + wake
    sleeps: dict[str, int] = field(default_factory=dict)  # cause -> count
    awake: bool = False
    queue_length: int = 0
    memory_bytes: int = 0  # weights on the device now


def _num(value: float) -> str:
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _hist(name: str, model: str, h: Histogram) -> list[str]:
    out, running = [], 0
    m = _label(model)
    for bound, n in zip(h.bounds_s, h.counts, strict=False):
        running += n
        out.append(f'{name}_bucket{{model="{m}",le="{_num(bound)}"}} {running}')
    out.append(f'{name}_bucket{{model="{m}",le="+Inf"}} {h.count}')
    out.append(f'{name}_sum{{model="{m}"}} {_num(h.sum_s)}')
    out.append(f'{name}_count{{model="{m}"}} {h.count}')
    return out


def render(models: dict[str, ModelMetrics]) -> str:
    """Prometheus text exposition (format 0.0.4) of every model's metrics, models in the
    order given."""
    p = PREFIX
    blocks: list[tuple[str, str, str, list[str]]] = [
        (f"{p}_requests_total", "counter", "Requests answered, by outcome (ok, error).", []),
        (f"{p}_time_to_first_token_seconds", "histogram",
         "Arrival to first token, queue and swap included.", []),
        (f"{p}_request_latency_seconds", "histogram",
         "From a request's arrival to its last token.", []),
        (f"{p}_swap_seconds", "histogram",
         "Bringing a model up: putting the victim to sleep and waking it.", []),
        (f"{p}_sleeps_total", "counter", "Times a model was put to sleep, by cause.", []),
        (f"{p}_awake", "gauge", "1 when the model's weights are on the device.", []),
        (f"{p}_queue_length", "gauge", "Requests waiting for the model.", []),
        (f"{p}_memory_bytes", "gauge", "Bytes of the model's weights on the device now.", []),
    ]  # fmt: skip
    for model, mm in models.items():
        m = _label(model)
        for outcome in sorted(mm.requests):
            blocks[0][3].append(f'{p}_requests_total{{model="{m}",outcome="{_label(outcome)}"}} '
                                f"{mm.requests[outcome]}")  # fmt: skip
        blocks[1][3].extend(_hist(blocks[1][0], model, mm.ttft_s))
        blocks[2][3].extend(_hist(blocks[2][0], model, mm.latency_s))
        blocks[3][3].extend(_hist(blocks[3][0], model, mm.wake_s))
        for cause in sorted(mm.sleeps):
            blocks[4][3].append(f'{p}_sleeps_total{{model="{m}",cause="{_label(cause)}"}} '
                                f"{mm.sleeps[cause]}")  # fmt: skip
        blocks[5][3].append(f'{p}_awake{{model="{m}"}} {int(mm.awake)}')
        blocks[6][3].append(f'{p}_queue_length{{model="{m}"}} {mm.queue_length}')
        blocks[7][3].append(f'{p}_memory_bytes{{model="{m}"}} {mm.memory_bytes}')
    lines: list[str] = []
    for name, kind, help_text, samples in blocks:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]
    return "\n".join(lines) + "\n"
