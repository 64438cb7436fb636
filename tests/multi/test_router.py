"""The multi-model router with real reference engine processes: routing by model, the
LRU swap, per-model queues, /v1/models, /metrics, the idle timeout and the budget."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("torch")

from spswap.errors import ConfigError  # noqa: E402
from spswap.multi import http_api  # noqa: E402
from spswap.multi.serve import start_router  # noqa: E402
from tests.helpers.multi import MAX_NEW, PROMPT, make_models, options  # noqa: E402
from tests.helpers.reference import cold_answers  # noqa: E402


def test_three_models_two_awake_route_swap_and_report(tmp_path, cfg):
    models = make_models(tmp_path, 3)
    cold = {m.name: cold_answers(m, [PROMPT], MAX_NEW)[0] for m in models}
    assert len({tuple(a) for a in cold.values()}) == 3  # the models really differ
    opts = options(tmp_path, models)
    router = start_router(cfg, opts, log=lambda _m: None)
    api = http_api.ApiServer(router, opts.socket_path)
    api.start()
    try:
        status, raw = http_api.request(opts.socket_path, "GET", "/v1/models")
        listed = {m["id"]: m["state"] for m in json.loads(raw)["data"]}
        assert status == 200 and listed == {"m0": "awake", "m1": "awake", "m2": "asleep"}
        # m2 asleep: m0 (least recently used: never) is put to sleep for it
        for name in ("m1", "m2", "m0", "m2"):
            answer = http_api.complete(opts.socket_path, name, PROMPT, MAX_NEW)
            assert answer["status"] == 200, answer
            assert answer["choices"][0]["token_ids"] == cold[name]
        states = {m["id"]: m["state"] for m in router.models()}
        assert states == {"m0": "awake", "m1": "asleep", "m2": "awake"}
        assert router.metrics["m0"].sleeps == {"demand": 1}
        assert router.metrics["m1"].sleeps == {"demand": 1}
        assert router.metrics["m2"].wake_s.count == 1
        assert router.metrics["m1"].memory_bytes == 0
        assert router.metrics["m0"].memory_bytes > 0
        status, raw = http_api.request(opts.socket_path, "GET", "/metrics")
        assert status == 200 and b'spswap_multi_awake{model="m2"} 1' in raw
        # a bad request names the fix and the server serves on
        bad = http_api.complete(opts.socket_path, "nope", PROMPT, MAX_NEW)
        assert bad["status"] == 404 and bad["error"]["message"] == (
            "no model 'nope' in this job; it serves: m0, m1, m2 (each named by its "
            "directory's name; GET /v1/models lists them)")  # fmt: skip
        bad = http_api.complete(opts.socket_path, "m0", [10**9], MAX_NEW)
        assert bad["status"] == 400 and "token ids" in bad["error"]["message"]
        status, raw = http_api.request(opts.socket_path, "POST", "/v1/completions",
                                       {"prompt": PROMPT})  # fmt: skip
        assert (status, json.loads(raw)["error"]["message"]) == (
            400, 'give "model": one of m0, m1, m2 (GET /v1/models)')  # fmt: skip
        # the right path with the wrong method says which method (it said "not here")
        status, raw = http_api.request(opts.socket_path, "GET", "/v1/completions")
        assert (status, json.loads(raw)["error"]["message"]) == (
            405,
            "/v1/completions takes POST (a JSON body with model, prompt, max_tokens)",
        )
        status, raw = http_api.request(opts.socket_path, "POST", "/v1/models", {})
        assert (status, json.loads(raw)["error"]["message"]) == (405, "/v1/models takes GET")
        conn = http_api._UnixConnection(opts.socket_path, 10.0)  # a 405 says what is allowed
        try:
            conn.request("GET", "/v1/completions")
            resp = conn.getresponse()
            assert (resp.status, resp.getheader("allow")) == (405, "POST")
            resp.read()
        finally:
            conn.close()
        # before a checkpoint every engine process gives its freed heap back (the
        # reference engine's too: it has no device caches), and serves on after it
        trimmed = router.trim_all()
        assert sorted(trimmed) == ["m0", "m1", "m2"]
        assert all(t["worker"]["heap_trimmed"] for t in trimmed.values()), trimmed
        assert http_api.complete(opts.socket_path, "m1", PROMPT, MAX_NEW)["status"] == 200
    finally:
        api.stop()
        router.close()


def test_queues_per_model_and_concurrent_swaps_give_cold_answers(tmp_path, cfg):
    models = make_models(tmp_path, 3)
    prompts = [[1 + i, 2, 3 + i] for i in range(4)]
    cold = {m.name: cold_answers(m, prompts, MAX_NEW) for m in models}
    router = start_router(cfg, options(tmp_path, models), log=lambda _m: None)
    try:
        futs = [
            (m.name, i, router.submit(m.name, p, MAX_NEW))
            for i, p in enumerate(prompts)
            for m in models
        ]
        for name, i, fut in futs:
            assert fut.result(120)["token_ids"] == cold[name][i]
        swaps = sum(sum(router.metrics[n].sleeps.values()) for n in router.specs)
        assert swaps >= 1
        assert sum(router.metrics[n].requests.get("ok", 0) for n in router.specs) == 12
    finally:
        router.close()


def test_idle_models_go_to_sleep(tmp_path, cfg):
    models = make_models(tmp_path, 2)
    router = start_router(cfg, options(tmp_path, models, idle_timeout_s=0.3), log=lambda _m: None)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(
            router.metrics[n].sleeps for n in router.specs
        ):
            time.sleep(0.1)
        assert router.placement.awake() == []
        assert router.metrics["m0"].sleeps == {"idle": 1}
        # and a request wakes it again
        assert router.submit("m0", PROMPT, MAX_NEW).result(60)["token_ids"] == \
            cold_answers(models[0], [PROMPT], MAX_NEW)[0]  # fmt: skip
    finally:
        router.close()


def test_a_set_over_the_swap_budget_is_refused_at_start(tmp_path, cfg):
    models = make_models(tmp_path, 3)
    with pytest.raises(ConfigError, match="3 models cannot meet --latency-target-s 1"):
        start_router(cfg, options(tmp_path, models, max_awake=1, latency_target_s=1.0,
                                  swap_s=0.6), log=lambda _m: None)  # fmt: skip


def test_a_running_request_finishes_before_its_model_is_put_to_sleep(tmp_path, cfg):
    """One awake slot: a request for m1 arriving while m0 answers waits for m0's answer
    (m0 is busy, never a victim mid-generation); both answers are the cold ones."""
    models = make_models(tmp_path, 2)
    long_prompt = [9, 8, 7]
    cold0 = cold_answers(models[0], [long_prompt], 120)[0]
    cold1 = cold_answers(models[1], [PROMPT], MAX_NEW)[0]
    router = start_router(cfg, options(tmp_path, models, max_awake=1), log=lambda _m: None)
    try:
        first = router.submit("m0", long_prompt, 120)
        deadline = time.monotonic() + 30
        while "m0" not in router.placement.busy and time.monotonic() < deadline:
            time.sleep(0.005)
        assert "m0" in router.placement.busy, "m0 never began its answer"
        second = router.submit("m1", PROMPT, MAX_NEW)
        a0, a1 = first.result(120), second.result(120)
        assert a0["token_ids"] == cold0 and a1["token_ids"] == cold1
        assert a1["latency_s"] > a0["generate_s"] * 0.5  # it waited for m0's answer
        assert router.metrics["m0"].sleeps == {"demand": 1}
    finally:
        router.close()


def test_serve_models_holds_its_awake_units_on_the_slot_table(tmp_path, cfg):
    import threading

    from spswap.multi.backend import serve_models
    from spswap.slots.table import SlotTable

    models = make_models(tmp_path, 3)
    opts = options(tmp_path, models, slot_gpus=(0,))
    stop = threading.Event()
    done: list[dict] = []
    t = threading.Thread(
        target=lambda: done.append(serve_models(cfg, opts, stop=stop, log=lambda _m: None))
    )
    t.start()
    try:
        deadline = time.monotonic() + 60
        while not opts.socket_path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert opts.socket_path.exists(), "the job's endpoint never opened"
        (held,) = SlotTable(cfg.paths.slots, [0]).reservations()
        assert (len(held.units), held.model) == (4, "m0+m1+m2")  # two awake, 2 units each
        assert http_api.complete(opts.socket_path, "m2", PROMPT, MAX_NEW)["status"] == 200
    finally:
        stop.set()
        t.join(60)
    assert done and SlotTable(cfg.paths.slots, [0]).reservations() == []


def test_spswap_status_shows_a_row_per_model_while_the_job_serves(tmp_path, cfg):
    import threading

    from spswap.multi.backend import serve_models
    from spswap.status import collect_status, render_instances

    models = make_models(tmp_path, 3)
    opts = options(tmp_path, models, slot_gpus=(0,))
    stop = threading.Event()
    t = threading.Thread(target=lambda: serve_models(cfg, opts, job_id="77", stop=stop,
                                                     log=lambda _m: None))  # fmt: skip
    t.start()
    try:
        deadline = time.monotonic() + 60
        while not opts.socket_path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert opts.socket_path.exists(), "the job's endpoint never opened"
        assert http_api.complete(opts.socket_path, "m2", PROMPT, MAX_NEW)["status"] == 200
        rows = {i["model"]: i for i in collect_status(cfg)["instances"]}
        assert {m: r["state"] for m, r in rows.items()} == {"m0": "sleep", "m1": "up",
                                                           "m2": "up"}  # fmt: skip
        assert all(r["job_id"] == "77" and r["alive"] and r["engine"] == "reference"
                   for r in rows.values())  # fmt: skip
        assert rows["m2"]["id"].startswith("77-") and rows["m2"]["id"].endswith("-m2")
        table = render_instances(list(rows.values()), now=time.time())
        assert len(table.rows) == 3
    finally:
        stop.set()
        t.join(60)
    assert collect_status(cfg)["instances"] == []  # the run's rows went with it


def test_a_long_idle_timeout_keeps_the_first_models_awake_at_the_start(tmp_path, cfg):
    """A model nobody asked yet is idle from the router's start, not since the clock's
    zero (the monotonic clock is the machine's uptime)."""
    router = start_router(cfg, options(tmp_path, make_models(tmp_path, 3), idle_timeout_s=60.0),
                          log=lambda _m: None)  # fmt: skip
    try:
        time.sleep(1.0)  # five rounds of the idle check
        assert {m["id"]: m["state"] for m in router.models()} == {
            "m0": "awake", "m1": "awake", "m2": "asleep"}  # fmt: skip
    finally:
        router.close()
