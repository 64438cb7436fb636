"""The check of a restore, as text: what the job log says when a restored instance answers
the check prompt otherwise than before its checkpoint, or cannot answer it."""

from __future__ import annotations

from spswap.serve.restore_check import refusal, restored_text, timings_text, tokens_text


def test_the_same_answer_serves_and_no_expectation_means_no_check() -> None:
    assert refusal([5, 6, 7], lambda: [5, 6, 7]) is None
    assert refusal(None, lambda: [1]) is None


def test_another_answer_is_refused_with_both_answers() -> None:
    assert refusal(list(range(10)), lambda: [9, 9]) == (
        "the restored instance does not serve: it answered the check prompt with [9, 9] "
        "where it answered [0, 1, 2, 3, 4, 5, 6, 7, ...] before its checkpoint: its weights "
        "or state did not come back whole; it ends, and the job's run starts cold"
    )


def test_no_answer_is_refused_with_the_error() -> None:
    def broken() -> list[int]:
        raise ConnectionRefusedError("the server is gone")

    assert refusal([1], broken) == (
        "the restored instance does not serve: it could not answer the check prompt (the "
        "server is gone): its weights or state did not come back whole; it ends, and the "
        "job's run starts cold"
    )
    assert tokens_text(None) == "nothing"


def test_a_restore_s_timings_read_in_milliseconds() -> None:
    assert timings_text({"thaw": 0.0003, "cuda_restore": 0.42, "kept": True, "n": "x"}) == \
        "unfreeze 0.3 ms, CUDA restore 0.42 s"  # fmt: skip
    # a tree restored at the prolog: its steps there apart; per-process figures and
    # totals stay in `spswap events`
    early = {"cuda_unlock": 0.00689, "early_verify": 0.00079, "early_criu_restore": 1.8419,
             "early_cuda_restore": 0.6157, "early_cuda_restore_pid1613": 0.0128,
             "early_wake_total": 0.6195, "verify": 0.0002, "thaw": 0.00041}  # fmt: skip
    assert timings_text(early) == (
        "at the job's prolog: image check 0.79 ms, CRIU restore 1.84 s, CUDA restore 0.62 s; "
        "when this run asked: CUDA unlock 6.89 ms, image check 0.2 ms, unfreeze 0.41 ms"
    )
    assert timings_text({"cuda_restore_pid7": 0.4}) == "no timings"
    # no "1e+02 ms" just under a tenth of a second
    assert (
        timings_text({"thaw": 0.0997, "verify": 0.0994}) == "unfreeze 0.10 s, image check 99.4 ms"
    )
    assert timings_text({}) == timings_text(None) == "no timings"


def test_the_restored_line_sets_the_check_beside_the_one_before_the_checkpoint() -> None:
    assert restored_text(
        "from its image", 2, wake_s=0.1234, check_s=0.15, check_before_s=0.05
    ) == (  # fmt: skip
        "spswap serve: restored from its image into run 2; weights back in 0.123 s, its "
        "check prompt answered as before in 0.150 s (it took 0.050 s before its checkpoint)"
    )
    assert restored_text("from its image", 1, wake_s=0.2, check_s=0.0, check_before_s=None) \
        == "spswap serve: restored from its image into run 1; weights back in 0.200 s"  # fmt: skip
    assert restored_text("from its kept instance", 3, wake_s=0.004, check_s=0.0,
                         check_before_s=None, saved=2) == (
        "spswap serve: restored from its kept instance into run 3; weights back in 0.004 s; "
        "2 saved request(s) to resume")  # fmt: skip


def test_a_run_that_started_cold_after_its_restored_instance_died_counts_its_answers() -> None:
    """Its restored instance ended on its own, so the run served from the pool: its last
    line is its own count, not that it stood in (the restored pid stays in the result)."""
    from pathlib import Path

    from spswap.serve.lifecycle import ServeResult
    from spswap.serve.run_end import run_end_text
    from spswap.serve.run_log import RunPath

    stood_in = ServeResult(restart_count=1, restored_pid=42, stopped_by="SIGTERM")
    assert run_end_text(stood_in, Path("/s"), spool=True).startswith("run 1 ends: it stood in")
    cold = ServeResult(restart_count=1, restored_pid=42, path=RunPath.POOL, answered=3,
                       stopped_by="SIGTERM")  # fmt: skip
    assert run_end_text(cold, Path("/s"), spool=True) == (
        "answered 3 in run 1 (answers in /s/outbox), 0 left in /s/inbox; stopped by SIGTERM"
    )
    first = ServeResult(restart_count=0, path=RunPath.COLD, answered=2)
    assert run_end_text(first, Path("/s"), spool=True) == (
        "answered 2 (answers in /s/outbox), 0 left in /s/inbox"
    )
    assert run_end_text(cold, Path("/s"), spool=False) == "stopped by SIGTERM"
