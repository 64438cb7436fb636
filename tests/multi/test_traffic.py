"""bench traffic on CPU: 3 models under a short Poisson run through the job's socket:
nothing failed, every answer the model's cold answer, swaps counted, metrics parsed."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from spswap.bench.traffic import TrafficOptions, bench_traffic  # noqa: E402
from spswap.bench.traffic_plan import (  # noqa: E402
    arrivals,
    highest_within,
    percentile,
    render,
    summarize,
)
from spswap.config import Config  # noqa: E402


def test_three_models_short_poisson_run(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    cfg = Config.from_env({}, root=tmp_path / "root")
    opts = TrafficOptions(model_counts=(3,), rates_per_min=(240.0,), duration_s=6.0,
                          max_new_tokens=4)  # fmt: skip
    result = bench_traffic(cfg, opts, scratch=tmp_path)
    (row,) = result["rows"]
    assert row["requests"] == len(arrivals(240.0, 6.0, 3)) > 10
    assert row["failed"] == 0 and row["wrong"] == 0
    assert row["swaps"] > 0 and row["swap_p50_s"] > 0
    families = {f.name: f for f in text_string_to_metric_families(result["metrics"])}
    sleeps = sum(s.value for s in families["spswap_multi_sleeps"].samples)
    assert sleeps == row["swaps"]
    answered = sum(s.value for s in families["spswap_multi_requests"].samples
                   if s.labels["outcome"] == "ok")  # fmt: skip
    assert answered == row["requests"]


def test_arrivals_are_poisson_and_repeatable():
    a = arrivals(60.0, 600.0, 4, seed=1)
    assert a == arrivals(60.0, 600.0, 4, seed=1)
    assert 500 < len(a) < 700  # mean 600
    assert {x.model for x in a} == {0, 1, 2, 3}
    assert all(0 < x.at_s < 600 for x in a)


def test_percentile_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(map(float, range(1, 101))), 95) == 95.0
    assert percentile([1.0, 9.0], 99) == 9.0


def test_summary_and_table_exact():
    rows = [
        summarize(2, 30.0, [0.1, 0.2, 0.3], 0, 0, [0.05], 60.0),
        summarize(2, 60.0, [0.5, 3.0], 1, 0, [], 60.0),
    ]
    assert rows[0].per_device_hour == 180.0 and rows[0].dedicated_per_device_hour == 90.0
    assert highest_within(rows, 2.0) == {2: 30.0}
    assert render(rows, 2.0) == (
        "models  rate/min  requests  failed  wrong  p50_s  p95_s  p99_s  swaps  swap_p50_s  "
        "req/device-h  dedicated\n"
        "     2        30         3       0      0  0.200  0.300  0.300      1       0.050  "
        "         180         90\n"
        "     2        60         3       1      0  0.500  3.000  3.000      0           -  "
        "         120         60\n"
        "2 models: highest rate within p95 <= 2 s: 30/min\n"
    )
