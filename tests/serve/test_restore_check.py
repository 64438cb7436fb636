"""The check of a restore, as text: what the job log says when a restored instance answers
the check prompt otherwise than before its checkpoint, or cannot answer it."""

from __future__ import annotations

import pytest

from spswap.errors import EngineError
from spswap.serve.restore_check import (
    LOGPROB_TOLERANCE,
    CheckAnswer,
    refusal,
    restored_text,
    timings_text,
    tokens_text,
)
from spswap.serve.vllm_run import probe_answer, probe_request

END = "its weights or state did not come back whole; it ends, and the job's run starts cold"


def test_the_same_answer_serves_and_no_expectation_means_no_check() -> None:
    assert refusal(CheckAnswer((5, 6, 7)), lambda: CheckAnswer((5, 6, 7))) is None
    assert refusal(None, lambda: CheckAnswer((1,))) is None
    before = CheckAnswer((5, 6), (-1.5, -0.25, -3.0))
    # within the tolerance: a kernel that reduced in another order
    near = CheckAnswer((5, 6), (-1.5 + LOGPROB_TOLERANCE * 0.9, -0.25, -3.0))
    assert refusal(before, lambda: near) is None


def test_another_answer_is_refused_with_both_answers() -> None:
    assert refusal(CheckAnswer(tuple(range(10))), lambda: CheckAnswer((9, 9))) == (
        "the restored instance does not serve: it answered the check prompt with [9, 9] "
        "where it answered [0, 1, 2, 3, 4, 5, 6, 7, ...] before its checkpoint: " + END
    )


def test_the_same_tokens_with_moved_logprobs_are_refused() -> None:
    """Greedy tokens can survive a damaged tensor; the log-probabilities do not."""
    before = CheckAnswer((5, 6), (-1.5, -0.25, -3.0))
    after = CheckAnswer((5, 6), (-1.5, -2.5, -3.0))
    assert refusal(before, lambda: after) == (
        "the restored instance does not serve: it answered the check prompt with the same "
        "tokens [5, 6] but log-probabilities up to 2.25 away from those before its "
        f"checkpoint (at most {LOGPROB_TOLERANCE} allowed): " + END
    )
    nan = CheckAnswer((5, 6), (-1.5, float("nan"), -3.0))
    assert "up to not a number away" in (refusal(before, lambda: nan) or "")
    fewer = CheckAnswer((5, 6), ())
    assert refusal(before, lambda: fewer) == (
        "the restored instance does not serve: it answered the check prompt with 0 "
        "log-probabilities where it gave 3 before its checkpoint: " + END
    )


def test_no_answer_is_refused_with_the_error() -> None:
    def broken() -> CheckAnswer:
        raise ConnectionRefusedError("the server is gone")

    assert refusal(CheckAnswer((1,)), broken) == (
        "the restored instance does not serve: it could not answer the check prompt (the "
        "server is gone): " + END
    )
    assert refusal(CheckAnswer((1,)), lambda: None) == (
        "the restored instance does not serve: it gave no answer to the check prompt: " + END
    )
    assert tokens_text(None) == "nothing"


def test_vllm_s_check_asks_for_logprobs_by_token_id_and_reads_them() -> None:
    """The request vLLM's completions endpoint gets (no tokenizer needed: the tokens are
    named by id; no model named: the server's own, whatever --served-model-name says),
    and the answer read from its response's shape (vLLM 0.26: with echo, one entry per
    prompt token, the first null, then one per answer token)."""
    assert probe_request(logprobs=True) == {
        "prompt": [3, 1, 4, 1, 5, 9, 2, 6], "max_tokens": 2, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True, "echo": True, "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }  # fmt: skip
    lps = [None, -9.5, -11.0, -8.25, -10.0, -12.5, -7.0, -9.0, -0.125, -0.5]
    response = {"choices": [{"index": 0, "text": "", "token_ids": [17, 4],
                             "logprobs": {"tokens": [f"token_id:{t}" for t in range(10)],
                                          "token_logprobs": lps,
                                          "top_logprobs": [None] + [{}] * 9}}]}  # fmt: skip
    assert probe_answer(response, logprobs=True) == CheckAnswer((17, 4), tuple(lps[1:]))


def test_vllm_s_check_without_its_logprobs_is_no_check() -> None:
    """A response that lost its log-probabilities (or has them misplaced) is an error:
    before a checkpoint that means no check (said in the log), after a restore a
    refusal; never a silently weaker check."""
    for lps in (None, [], [None, -1.0], [-1.0] * 10, [None] + [-1.0] * 8 + [None]):
        bad = {"choices": [{"token_ids": [17, 4], "logprobs": {"token_logprobs": lps}}]}
        with pytest.raises(EngineError, match="without its 9 log-probabilities"):
            probe_answer(bad, logprobs=True)
    with pytest.raises(EngineError):
        probe_answer({"choices": [{"token_ids": [17, 4]}]}, logprobs=True)


def test_vllm_s_check_asks_tokens_alone_where_the_engine_was_busy() -> None:
    """A request still running when the check was asked before the checkpoint shares its
    batch (log-probabilities are not batch-invariant): 8 tokens then, and the same
    after the restore (asked as the answer it is compared with was)."""
    assert probe_request(logprobs=False) == {
        "prompt": [3, 1, 4, 1, 5, 9, 2, 6], "max_tokens": 8, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    answer = probe_answer({"choices": [{"token_ids": list(range(8))}]}, logprobs=False)
    assert answer == CheckAnswer(tuple(range(8)))


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
        "from its image", 2, wake_s=0.1234, check_s=0.15, check_first_s=0.05
    ) == (  # fmt: skip
        "spswap serve: restored from its image into run 2; weights back in 0.123 s, its "
        "check prompt answered as before in 0.150 s (it took 0.050 s when first asked)"
    )
    # a multi-model job: each awake model answered its check
    assert restored_text("from its kept instance", 1, wake_s=0.018, check_s=0.104,
                         check_first_s=0.072, saved=0, several=True) == (
        "spswap serve: restored from its kept instance into run 1; weights back in 0.018 s, "
        "its awake models' check prompts answered as before in 0.104 s (they took 0.072 s "
        "when first asked); 0 saved request(s) to resume")  # fmt: skip
    assert restored_text("from its image", 1, wake_s=0.2, check_s=0.0, check_first_s=None) \
        == "spswap serve: restored from its image into run 1; weights back in 0.200 s"  # fmt: skip
    assert restored_text("from its kept instance", 3, wake_s=0.004, check_s=0.0,
                         check_first_s=None, saved=2) == (
        "spswap serve: restored from its kept instance into run 3; weights back in 0.004 s; "
        "2 saved request(s) to resume")  # fmt: skip


def test_a_run_that_started_cold_after_its_restored_instance_died_counts_its_answers() -> None:
    """Its restored instance ended on its own, so the run served from the pool: its last
    line is its own count, not that it stood in (the restored pid stays in the result)."""
    from pathlib import Path

    from spswap.serve.backend import ServeResult
    from spswap.serve.run_end import run_end_text
    from spswap.serve.run_log import RunPath

    stood_in = ServeResult(restart_count=1, restored_pid=42, stopped_by="SIGTERM")
    assert run_end_text(stood_in, Path("/s"), spool=True).startswith("run 1 ends: it stood in")
    cold = ServeResult(restart_count=1, restored_pid=42, path=RunPath.POOL, answered=3,
                       stopped_by="SIGTERM")  # fmt: skip
    assert run_end_text(cold, Path("/s"), spool=True) == (
        "answered 3 in run 1 (answers in /s/outbox), 0 left in /s/inbox; stopped by SIGTERM"
    )
    # the walk: "answered 0 in run 4 (1 in all its runs)" after 4 answers in runs 0-3 (the
    # instance's own count, which restarts where a run starts anew): the job's outbox's
    restored = ServeResult(restart_count=4, path=RunPath.POOL, answered=1, answered_before=1)
    assert run_end_text(restored, Path("/s"), spool=True, job_answered=4) == (
        "answered 0 in run 4, 4 in all the job's runs (answers in /s/outbox), 0 left in /s/inbox"
    )
    assert run_end_text(cold, Path("/s"), spool=True, job_answered=3).startswith(
        "answered 3 in run 1 (answers"
    )  # all of them in this run: said once
    refused = ServeResult(
        restart_count=2,
        path=RunPath.POOL,
        answered=6,
        answered_before=6,
        events=[{"restored": True, "probe": "mismatch", "reason": "..."}],
    )
    assert run_end_text(refused, Path("/s"), spool=True) == (  # not "answered 0 in run 2"
        "run 2's restored instance ends without serving; the job's run starts anew"
    )
    first = ServeResult(restart_count=0, path=RunPath.COLD, answered=2)
    assert run_end_text(first, Path("/s"), spool=True) == (
        "answered 2 (answers in /s/outbox), 0 left in /s/inbox"
    )
    assert run_end_text(cold, Path("/s"), spool=False) == "stopped by SIGTERM"


def test_a_refused_restore_is_told_to_the_run_that_stands_in_for_it(tmp_path) -> None:
    """The run standing in sees only that its restored instance ended: the instance's note
    (for that run only) lets it say the check failed, not that it ended on its own."""
    from spswap.serve.restore_check import REFUSED_FILE, note_refused, refused_in

    assert refused_in(tmp_path, 2) is None
    note_refused(tmp_path, 2, "the restored instance does not serve: ...")
    assert refused_in(tmp_path, 2) == "the restored instance does not serve: ..."
    assert refused_in(tmp_path, 3) is None  # a later run's instance was not refused
    (tmp_path / REFUSED_FILE).write_text("{")  # torn: no note, never an error
    assert refused_in(tmp_path, 2) is None
    note_refused(tmp_path / "gone", 2, "x")  # no state dir: nothing, no error
