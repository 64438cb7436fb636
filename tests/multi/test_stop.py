"""A stop of a multi-model job, in one process with real reference engine processes: the
router pauses (the answer being made finishes, queued requests stay queued), a client
that waits is told to ask again (kept by its X-Request-Id, dropped without one), every
model sleeps and every connection is cut, then the restored side wakes and answers the
kept request: the same answer as the cold model's. (The checkpoint of the process tree
in between is spswapd's: tests/slurm/test_multi_preempt.py.)"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("torch")

from spswap.errors import RequestRejected  # noqa: E402
from spswap.multi import http_api  # noqa: E402
from spswap.multi.serve import start_router  # noqa: E402
from spswap.pool.store import Pool  # noqa: E402
from spswap.serve import restore_check  # noqa: E402
from tests.helpers.damage import reverse_largest_tensor  # noqa: E402
from tests.helpers.multi import MAX_NEW, PROMPT, make_models, options  # noqa: E402
from tests.helpers.reference import cold_answers  # noqa: E402


def _wait(what: str, check, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_stop_keeps_the_queue_and_an_id_finds_its_answer_after_the_wake(tmp_path, cfg):
    models = make_models(tmp_path, 2)
    cold = {m.name: cold_answers(m, [PROMPT], MAX_NEW)[0] for m in models}
    opts = options(tmp_path, models)
    router = start_router(cfg, opts, log=lambda _m: None)
    api = http_api.ApiServer(router, opts.socket_path)
    api.start()
    try:
        assert router.pause(5.0) == 0 and router.paused
        answers: dict[str, dict] = {}

        def ask(key: str, request_id: str | None) -> None:
            answers[key] = http_api.complete(opts.socket_path, "m1", PROMPT, MAX_NEW,
                                             request_id=request_id)  # fmt: skip

        # paused: a new request is refused with what to do
        ask("new", None)
        assert answers["new"]["status"] == 503 and "ask again" in answers["new"]["error"]["message"]
        router.resume()
        # two requests queued behind the one m1 is answering when the stop comes
        busy = threading.Thread(target=ask, args=("busy", None))
        threads = [threading.Thread(target=ask, args=(k, rid))
                   for k, rid in (("kept", "job-req-1"), ("dropped", None))]  # fmt: skip
        with router.procs["m1"]._lock:  # m1's engine held: its answer cannot finish
            busy.start()
            _wait("m1 answering", lambda: router._busy == 1)
            for t in threads:
                t.start()
            _wait("two queued", lambda: router.queued() == 2)
            router._running.clear()  # the stop (pause() would wait for m1's answer)
            for t in threads:
                t.join(10)
            assert "busy" not in answers  # the answer being made is not cut off
        busy.join(30)
        assert answers["busy"]["status"] == 200
        assert answers["busy"]["choices"][0]["token_ids"] == cold["m1"]
        kept, dropped = answers["kept"], answers["dropped"]
        assert kept["status"] == 503 and "request job-req-1 is kept" in kept["error"]["message"]
        assert dropped["status"] == 503 and "X-Request-Id" in dropped["error"]["message"]
        assert router.pause(5.0) == 0
        assert sorted(router.sleep_all()) == ["m0", "m1"]
        api.stop()
        assert not opts.socket_path.exists()
        # ... spswapd checkpoints the tree here; the job's next run restores it ...
        assert sorted(router.wake_all()) == ["m0", "m1"]
        api.start()
        router.resume()
        again = http_api.complete(opts.socket_path, "m1", PROMPT, MAX_NEW,
                                  request_id="job-req-1")  # fmt: skip
        assert again["status"] == 200 and again["choices"][0]["token_ids"] == cold["m1"]
        once_more = http_api.complete(opts.socket_path, "m1", PROMPT, MAX_NEW,
                                      request_id="job-req-1")  # fmt: skip
        assert once_more == again and again["id"] == "cmpl-job-req-1"  # the same answer
        # the dropped one was not answered in the dark: two answers made (busy, kept)
        assert router.metrics["m1"].requests == {"ok": 2}
        # the same id for another request is refused, saying what to do
        with pytest.raises(RequestRejected, match="give a new id"):
            router.submit("m0", PROMPT, MAX_NEW, "job-req-1")
        bad = http_api.complete(opts.socket_path, "m0", PROMPT, MAX_NEW, request_id="no spaces")
        assert bad["status"] == 400 and "X-Request-Id" in bad["error"]["message"]
    finally:
        api.stop()
        router.close()


def test_a_stop_cuts_idle_keep_alive_connections_at_once(tmp_path, cfg):
    models = make_models(tmp_path, 1)
    opts = options(tmp_path, models)
    router = start_router(cfg, opts, log=lambda _m: None)
    api = http_api.ApiServer(router, opts.socket_path)
    api.start()
    conn = http_api._UnixConnection(opts.socket_path, 10.0)
    try:
        conn.request("GET", "/v1/models")
        assert conn.getresponse().read()  # the connection stays open (HTTP/1.1)
        t0 = time.monotonic()
        api.stop()
        assert time.monotonic() - t0 < http_api.CLOSE_WAIT_S  # not held by the idle one
        with pytest.raises((ConnectionError, OSError, http_api.http.client.HTTPException)):
            conn.request("GET", "/v1/models")
            conn.getresponse()
    finally:
        conn.close()
        router.close()


def test_the_restore_check_asks_every_awake_model_and_sees_a_damaged_entry(tmp_path, cfg):
    """The check a restored multi-model job passes before it answers again (its lifecycle
    asks it before the checkpoint and after the wake): every awake model's greedy answer
    to the check prompt, the same after a sleep and a wake, and not the same once a whole
    tensor of one model's pool entry was overwritten while it slept."""
    models = make_models(tmp_path, 3)
    router = start_router(cfg, options(tmp_path, models), log=lambda _m: None)
    prompt, n = list(restore_check.PROBE_PROMPT), restore_check.PROBE_TOKENS

    def probe() -> restore_check.CheckAnswer:
        answers = router.probe_awake(prompt, n)
        return restore_check.CheckAnswer(tuple(t for a in answers.values() for t in a))

    try:
        cold = {m.name: cold_answers(m, [prompt], n)[0] for m in models}
        before = probe()
        assert list(before.token_ids) == cold["m0"] + cold["m1"]  # the awake two, in order
        assert router.pause(5.0) == 0
        assert sorted(router.sleep_all()) == ["m0", "m1"]
        router.wake_all()
        assert restore_check.refusal(before, probe) is None
        router.sleep_all()
        pool = Pool.from_config(cfg)
        (m1,) = [e for e in pool.entries() if e.manifest.name == "m1"]
        reverse_largest_tensor(pool, m1.manifest)
        router.wake_all()
        why = restore_check.refusal(before, probe)
        assert why is not None and "the restored instance does not serve" in why, why
        assert router.metrics["m0"].requests == {}  # the checks are no requests
    finally:
        router.close()


def test_a_damaged_entry_found_after_a_failed_restore_is_imported_again(tmp_path, cfg):
    """A restored multi-model job whose check failed: before the cold start each model's
    entry is read against its checksums, a damaged one removed and its model imported
    again from its files (before, the run refused to start until root ran `spswap pool
    rm`); the other models' entries stay as they were."""
    from spswap.multi.backend import multi_run
    from spswap.serve.backend import ServeResult

    models = make_models(tmp_path, 2)
    run = multi_run(cfg, options(tmp_path, models), log=lambda _m: None)
    backend = run.backend
    backend.prepare(ServeResult())
    assert backend.check_pool() is None  # whole: nothing said, nothing removed
    pool = Pool.from_config(cfg)
    m1 = next(m for m in backend.manifests if m.name == models[1].name)
    m0_created = next(
        e for e in pool.entries() if e.manifest.name == models[0].name
    ).manifest.created
    tensor = reverse_largest_tensor(pool, m1)
    found = backend.check_pool()
    assert found is not None and f"tensor {tensor.name!r}" in found, found
    assert found.endswith(f"; {m1.name} starts from its files, into the pool again"), found
    assert backend.damaged is None
    again = {e.manifest.name: e for e in pool.entries()}
    assert sorted(again) == sorted(m.name for m in models)
    pool.verify(again[m1.name].manifest.digest)  # whole again, the same weights
    assert again[m1.name].manifest.digest == m1.digest
    assert again[models[0].name].manifest.created == m0_created  # not imported again


def test_every_models_entry_is_checked_not_only_the_first_damaged_one(tmp_path, cfg):
    from spswap.multi.backend import multi_run
    from spswap.serve.backend import ServeResult

    models = make_models(tmp_path, 2)
    backend = multi_run(cfg, options(tmp_path, models), log=lambda _m: None).backend
    backend.prepare(ServeResult())
    pool = Pool.from_config(cfg)
    for m in backend.manifests:
        reverse_largest_tensor(pool, m)
    found = backend.check_pool()
    assert found is not None and all(f"{m.name} starts from its files" in found
                                     for m in models), found  # fmt: skip
    for e in pool.entries():
        pool.verify(e.manifest.digest)  # both whole again
    assert len(pool.entries()) == 2


def test_a_model_asked_at_one_stop_is_not_asked_again_before_the_next_dump(tmp_path, cfg):
    """The check's answer a multi-model job takes before its dump: each awake model is
    asked once in the job (each answer holds the GPU from the preempting job); after a
    restore every awake model is asked. Seen through a pool entry damaged while its model
    slept: before the next dump the answer is the first one, after the wake it is not."""
    from spswap.multi.backend import multi_run
    from spswap.serve.backend import ServeResult

    models = make_models(tmp_path, 3)
    backend = multi_run(cfg, options(tmp_path, models), log=lambda _m: None).backend
    result = ServeResult()
    backend.prepare(result)
    backend.start(result)
    router = backend.router
    try:
        cold = {m.name: cold_answers(m, [list(restore_check.PROBE_PROMPT)],
                                     restore_check.PROBE_TOKENS)[0] for m in models}  # fmt: skip
        first = backend.probe()
        assert first is not None and list(first.token_ids) == cold["m0"] + cold["m1"]
        assert sorted(backend.check_answers) == ["m0", "m1"]
        assert router.pause(5.0) == 0
        router.sleep_all()
        pool = Pool.from_config(cfg)
        (m1,) = [e for e in pool.entries() if e.manifest.name == "m1"]
        reverse_largest_tensor(pool, m1.manifest)
        router.wake_all()  # m1 answers otherwise now
        again = backend.probe()
        assert again == first  # not asked again
        # the time the job log gives is the first asking's, not a lookup's
        assert first.asked_s is not None and first.asked_s > 0
        assert again is not None and again.asked_s == first.asked_s
        why = restore_check.refusal(first, lambda: backend.probe(first))  # a restore's: asked
        assert why is not None and "the restored instance does not serve" in why, why
    finally:
        backend.router = None
        router.close()
