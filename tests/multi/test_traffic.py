"""bench traffic on CPU: 3 models under a short Poisson run through the job's socket:
nothing failed, every answer the model's cold answer, swaps counted, metrics parsed."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from spswap.bench.traffic import TrafficOptions, bench_traffic  # noqa: E402
from spswap.bench.traffic_plan import (  # noqa: E402
    arrivals,
    check_rates,
    highest_within,
    parse_rates,
    percentile,
    prompt_set,
    render,
    summarize,
)
from spswap.config import Config  # noqa: E402
from spswap.errors import ConfigError  # noqa: E402


def test_three_models_short_poisson_run(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    cfg = Config.from_env({}, root=tmp_path / "root")
    opts = TrafficOptions(model_counts=(3,), rates_per_min=(240.0,), duration_s=6.0,
                          max_new_tokens=4)  # fmt: skip
    result = bench_traffic(cfg, opts, scratch=tmp_path)
    (row,) = result["rows"]
    assert row["awake"] == 2  # as the default --units allow (the row said 'all' before)
    assert row["models"] == 3  # the word highest_rate_within_target uses (was n_models)
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
        summarize(2, 30.0, [0.1], 0, 0, [0.05, 0.07], 60.0, awake=1),
    ]
    assert rows[0].per_device_hour == 180.0 and rows[0].dedicated_per_device_hour == 90.0
    assert highest_within(rows, 2.0) == [
        {"models": 2, "awake": None, "rate_per_min": 30.0},
        {"models": 2, "awake": 1, "rate_per_min": 30.0},
    ]
    assert highest_within(rows, 0.01)[0] == {"models": 2, "awake": None, "rate_per_min": None}
    text = render(rows, 2.0)
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert text == (
        "requests (seconds)\n"
        "models  awake  rate/min  requests  failed  wrong  p50_s  p95_s  p99_s\n"
        "     2      -        30         3       0      0  0.200  0.300  0.300\n"
        "     2      -        60         3       1      0  0.500  3.000  3.000\n"
        "     2      1        30         1       0      0  0.100  0.100  0.100\n"
        "swaps (seconds); requests per device-hour, shared and one device per model\n"
        "models  awake  rate/min  swaps  swap_p50_s  swap_p95_s  shared/h  dedicated/h\n"
        "     2      -        30      1       0.050       0.050       180           90\n"
        "     2      -        60      0           -           -       120           60\n"
        "     2      1        30      2       0.050       0.070        60           30\n"
        "2 models: highest rate within p95 <= 2 s: 30/min\n"
        "2 models, 1 awake: highest rate within p95 <= 2 s: 30/min\n"
    )


def test_rates_for_every_count_and_for_one():
    assert parse_rates("30,60") == ((30.0, 60.0), {})
    assert parse_rates("4:64, 6:48,10") == ((10.0,), {4: (64.0,), 6: (48.0,)})
    opts = TrafficOptions(rates_per_min=(10.0,), rates_by_count=((4, (64.0,)),))
    assert opts.rates(4) == (10.0, 64.0) and opts.rates(6) == (10.0,)
    with pytest.raises(ConfigError, match="neither a rate per minute"):
        parse_rates("4:x")
    with pytest.raises(ConfigError, match="positive"):
        parse_rates("0:5")
    with pytest.raises(ConfigError, match="at least one rate"):
        parse_rates(" , ")


def test_a_model_count_without_a_rate_is_refused():
    check_rates((2, 4), (30.0,), {})
    check_rates((4,), (), {4: (64.0,)})
    with pytest.raises(ConfigError, match=r"--rates gives no rate for 2 models: .* 2:30"):
        check_rates((2, 4), (), {4: (64.0,)})


def test_a_rows_log_line_exactly():
    row = summarize(2, 30.0, [0.1, 0.2, 0.3], 0, 0, [0.05], 60.0, awake=1)
    assert row.line() == (
        "2 models, 1 awake, 30/min: 3 requests, 0 failed, 0 wrong, p50 0.200 s, p95 0.300 s, "
        "p99 0.300 s; 1 swap, p50 0.050 s, p95 0.050 s"
    )
    unset = summarize(2, 60.0, [], 1, 0, [], 60.0).line()  # awake 0: as the units allow
    assert unset.startswith("2 models, as many awake as fit, 60/min: 1 requests, 1 failed")
    assert unset.endswith("p50 -, p95 -")


def test_a_vllm_run_asks_a_fixed_set_of_prompts():
    prompts = prompt_set(16, seed=3)
    assert prompts == prompt_set(16, seed=3) and len(set(prompts)) == 16
    plan = arrivals(120.0, 120.0, 4, prompts=prompts)
    assert {a.prompt_ids for a in plan} <= set(prompts)
    assert len({a.prompt_ids for a in plan}) > 8


def test_an_unknown_engine_is_refused_before_any_model_starts(tmp_path):
    cfg = Config.from_env({}, root=tmp_path / "root")
    said: list[str] = []
    with pytest.raises(ConfigError) as e:
        bench_traffic(cfg, TrafficOptions(model_counts=(2,), engine="vlm"), log=said.append)
    assert str(e.value) == "unknown engine 'vlm'; valid engines: reference, vllm"
    assert said == []  # (it said "starting 2 models (vlm)" first)


def test_too_few_model_directories_are_counted_in_words(tmp_path):
    cfg = Config.from_env({}, root=tmp_path / "root")
    (tmp_path / "m").mkdir()
    with pytest.raises(ConfigError) as e:
        bench_traffic(cfg, TrafficOptions(model_counts=(2,), models=(tmp_path / "m",)))
    assert str(e.value) == ("--models gives 1 directory but a run with 2 models was asked "
                            "(--model-counts)")  # fmt: skip


def test_too_few_model_directories_for_the_largest_count_are_refused_before_any_run(tmp_path):
    """--model-counts 1,3 with two --models ran the 1-model rates in full first."""
    cfg = Config.from_env({}, root=tmp_path / "root")
    dirs = (tmp_path / "a", tmp_path / "b")
    for d in dirs:
        d.mkdir()
    said: list[str] = []
    with pytest.raises(ConfigError, match="--models gives 2 directories but a run with 3"):
        bench_traffic(cfg, TrafficOptions(model_counts=(1, 3), models=dirs), log=said.append)
    assert said == []  # nothing started


def test_a_missing_model_directory_is_an_input_error(tmp_path):
    cfg = Config.from_env({}, root=tmp_path / "root")
    with pytest.raises(ConfigError) as e:
        bench_traffic(cfg, TrafficOptions(model_counts=(1,), models=(tmp_path / "nope",)))
    assert str(e.value) == (f"--models {tmp_path / 'nope'}: no such directory; give a model "
                            "directory (config.json + model.safetensors)")  # fmt: skip


def test_vllm_needs_model_directories(tmp_path):
    cfg = Config.from_env({}, root=tmp_path / "root")
    with pytest.raises(ConfigError, match="--models DIR"):
        bench_traffic(cfg, TrafficOptions(model_counts=(2,), engine="vllm"))


def test_two_then_one_awake_on_the_same_engines(tmp_path):
    cfg = Config.from_env({}, root=tmp_path / "root")
    out = tmp_path / "report.json"
    opts = TrafficOptions(model_counts=(3,), rates_per_min=(), rates_by_count=((3, (300.0,)),),
                          duration_s=3.0, max_new_tokens=3, awake=(2, 1), out=out)  # fmt: skip
    result = bench_traffic(cfg, opts, scratch=tmp_path)
    assert [(r["awake"], r["rate_per_min"]) for r in result["rows"]] == [(2, 300.0), (1, 300.0)]
    assert all(r["failed"] == 0 and r["wrong"] == 0 for r in result["rows"])
    assert result["rows"][1]["swaps"] > 0
    assert [(b["models"], b["awake"]) for b in result["highest_rate_within_target"]] == [
        (3, 2), (3, 1)]  # fmt: skip
    assert [s["from"] for s in result["starts"]] == ["pool"] * 3
    assert json.loads(out.read_text())["rows"] == result["rows"]


def test_more_awake_than_models_is_said_not_lowered_silently(tmp_path):
    cfg = Config.from_env({}, root=tmp_path / "root")
    said: list[str] = []
    opts = TrafficOptions(model_counts=(2,), rates_per_min=(120.0,), duration_s=2.0,
                          max_new_tokens=2, awake=(3,))  # fmt: skip
    result = bench_traffic(cfg, opts, scratch=tmp_path, log=said.append)
    assert [r["awake"] for r in result["rows"]] == [2]
    assert ("bench traffic: --awake 3: 2 awake with 2 models (at most one per model, and as "
            "--units allows)") in said, said  # fmt: skip
