"""The metrics text: exact output, and prometheus_client's own parser reads it."""

from __future__ import annotations

from spswap.multi.metrics import Histogram, ModelMetrics, render


def _sample() -> dict[str, ModelMetrics]:
    a = ModelMetrics(requests={"ok": 3, "error": 1}, sleeps={"demand": 2, "idle": 1},
                     awake=True, queue_length=2, memory_bytes=4096)  # fmt: skip
    a.ttft_s = Histogram((0.1, 1.0))
    a.latency_s = Histogram((0.1, 1.0))
    a.wake_s = Histogram((0.1, 1.0))
    for v in (0.05, 0.5, 2.0):
        a.ttft_s.observe(v)
    a.latency_s.observe(0.25)
    b = ModelMetrics()
    b.ttft_s = b.latency_s = b.wake_s = Histogram((0.1,))
    return {"a": a, 'q"x': b}


EXPECTED = """\
# HELP spswap_multi_requests_total Requests answered, by outcome (ok, error).
# TYPE spswap_multi_requests_total counter
spswap_multi_requests_total{model="a",outcome="error"} 1
spswap_multi_requests_total{model="a",outcome="ok"} 3
# HELP spswap_multi_time_to_first_token_seconds Arrival to first token, queue and swap included.
# TYPE spswap_multi_time_to_first_token_seconds histogram
spswap_multi_time_to_first_token_seconds_bucket{model="a",le="0.1"} 1
spswap_multi_time_to_first_token_seconds_bucket{model="a",le="1"} 2
spswap_multi_time_to_first_token_seconds_bucket{model="a",le="+Inf"} 3
spswap_multi_time_to_first_token_seconds_sum{model="a"} 2.55
spswap_multi_time_to_first_token_seconds_count{model="a"} 3
spswap_multi_time_to_first_token_seconds_bucket{model="q\\"x",le="0.1"} 0
spswap_multi_time_to_first_token_seconds_bucket{model="q\\"x",le="+Inf"} 0
spswap_multi_time_to_first_token_seconds_sum{model="q\\"x"} 0
spswap_multi_time_to_first_token_seconds_count{model="q\\"x"} 0
# HELP spswap_multi_request_latency_seconds From a request's arrival to its last token.
# TYPE spswap_multi_request_latency_seconds histogram
spswap_multi_request_latency_seconds_bucket{model="a",le="0.1"} 0
spswap_multi_request_latency_seconds_bucket{model="a",le="1"} 1
spswap_multi_request_latency_seconds_bucket{model="a",le="+Inf"} 1
spswap_multi_request_latency_seconds_sum{model="a"} 0.25
spswap_multi_request_latency_seconds_count{model="a"} 1
spswap_multi_request_latency_seconds_bucket{model="q\\"x",le="0.1"} 0
spswap_multi_request_latency_seconds_bucket{model="q\\"x",le="+Inf"} 0
spswap_multi_request_latency_seconds_sum{model="q\\"x"} 0
spswap_multi_request_latency_seconds_count{model="q\\"x"} 0
# HELP spswap_multi_swap_seconds Bringing a model up: putting the victim to sleep and waking it.
# TYPE spswap_multi_swap_seconds histogram
spswap_multi_swap_seconds_bucket{model="a",le="0.1"} 0
spswap_multi_swap_seconds_bucket{model="a",le="1"} 0
spswap_multi_swap_seconds_bucket{model="a",le="+Inf"} 0
spswap_multi_swap_seconds_sum{model="a"} 0
spswap_multi_swap_seconds_count{model="a"} 0
spswap_multi_swap_seconds_bucket{model="q\\"x",le="0.1"} 0
spswap_multi_swap_seconds_bucket{model="q\\"x",le="+Inf"} 0
spswap_multi_swap_seconds_sum{model="q\\"x"} 0
spswap_multi_swap_seconds_count{model="q\\"x"} 0
# HELP spswap_multi_sleeps_total Times a model was put to sleep, by cause.
# TYPE spswap_multi_sleeps_total counter
spswap_multi_sleeps_total{model="a",cause="demand"} 2
spswap_multi_sleeps_total{model="a",cause="idle"} 1
# HELP spswap_multi_awake 1 when the model's weights are on the device.
# TYPE spswap_multi_awake gauge
spswap_multi_awake{model="a"} 1
spswap_multi_awake{model="q\\"x"} 0
# HELP spswap_multi_queue_length Requests waiting for the model.
# TYPE spswap_multi_queue_length gauge
spswap_multi_queue_length{model="a"} 2
spswap_multi_queue_length{model="q\\"x"} 0
# HELP spswap_multi_memory_bytes Bytes of the model's weights on the device now.
# TYPE spswap_multi_memory_bytes gauge
spswap_multi_memory_bytes{model="a"} 4096
spswap_multi_memory_bytes{model="q\\"x"} 0
"""


def test_render_exact():
    assert render(_sample()) == EXPECTED


def test_prometheus_client_parses_it():
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(render(_sample()))}
    assert families["spswap_multi_requests"].type == "counter"
    ttft = families["spswap_multi_time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    buckets = [
        (s.labels["le"], s.value)
        for s in ttft.samples
        if s.name.endswith("_bucket") and s.labels["model"] == "a"
    ]
    assert buckets == [("0.1", 1.0), ("1", 2.0), ("+Inf", 3.0)]
    awake = {s.labels["model"]: s.value for s in families["spswap_multi_awake"].samples}
    assert awake == {"a": 1.0, 'q"x': 0.0}
