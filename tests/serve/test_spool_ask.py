"""`spswap ask --job N` / `--state-dir D`: a request through the job's spool, from
anywhere its state directory is seen, answered by a real server process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spswap.errors import SpswapError
from spswap.serve.spool import Spool
from spswap.serve.spool_ask import ask_spool, state_dir_of

torch = pytest.importorskip("torch")
from spswap.engines.reference import save_checkpoint  # noqa: E402
from spswap.engines.reference_model import preset  # noqa: E402
from tests.helpers.reference import cold_answers  # noqa: E402


def test_ask_by_state_dir_is_answered_by_the_server(tmp_path: Path) -> None:
    model = tmp_path / "model"
    save_checkpoint(preset("tiny"), model)
    state = tmp_path / "work" / ".spswap" / "42"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SPSWAP_ROOT"] = str(tmp_path / "root")
    proc = subprocess.Popen([sys.executable, "-m", "spswap.cli", "serve", str(model),
                             "--state-dir", str(state), "--device", "cpu"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not (state / "outbox").is_dir():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        cli = subprocess.run([sys.executable, "-m", "spswap.cli", "ask", "4,5,6",
                              "--max-new-tokens", "5", "--state-dir", str(state)],
                             env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        (want,) = cold_answers(model, [[4, 5, 6]], 5)
        assert cli.stdout.strip() == ",".join(map(str, want))
        bad = ask_spool(state, {"prompt_ids": [99999], "max_new_tokens": 2}, timeout_s=60)
        assert bad["ok"] is False and "token ids must lie in" in bad["error"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_a_request_not_answered_in_time_is_saved_with_its_id(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    spool.create()
    out = ask_spool(tmp_path / "s", {"id": "later", "prompt_ids": [1], "max_new_tokens": 2},
                    timeout_s=0.1)  # fmt: skip
    assert out["saved"] is True and out["id"] == "later" and "waits in" in out["error"]
    assert [r.id for r in spool.pending()] == ["later"]
    # later, by its id alone: still waiting, then answered (as the job's next run does)
    again = ask_spool(tmp_path / "s", {"id": "later"}, timeout_s=0.1)
    assert again["saved"] is True and again["id"] == "later"
    (req,) = spool.pending()
    spool.complete(req, [7, 8])
    assert ask_spool(tmp_path / "s", {"id": "later"}, timeout_s=0.1)["output_ids"] == [7, 8]
    with pytest.raises(SpswapError, match="^no request never was asked of this job .*: give its "
                       "prompt to ask it$"):  # fmt: skip
        ask_spool(tmp_path / "s", {"id": "never"}, timeout_s=0.1)
    with pytest.raises(SpswapError, match="request id '../x' must be"):
        ask_spool(tmp_path / "s", {"id": "../x"}, timeout_s=0.1)


def test_a_directory_without_a_spool_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpswapError, match="has no spool"):
        ask_spool(tmp_path, {"prompt_ids": [1]}, timeout_s=1)
    assert state_dir_of("/home/u/run", "7") == Path("/home/u/run/.spswap/7")


def test_ask_by_state_dir_names_a_missing_path_and_the_jobs_of_their_folder(
    tmp_path: Path,
) -> None:
    """A newcomer's walk (2026-12-08): a path that is not there, and the templates'
    WORKDIR/.spswap (the folder of the jobs' state directories), were both asked "is it
    the state directory of a serving job?"."""
    from spswap.serve.spool_ask import no_state_dir_text

    gone = tmp_path / "nope"
    with pytest.raises(SpswapError) as e:
        ask_spool(gone, {"prompt_ids": [1]}, timeout_s=1)
    assert str(e.value) == (
        f"{gone} does not exist: give a serving job's state directory (the templates keep it "
        "in WORKDIR/.spswap/JOB_ID), or ask with --job JOB_ID"
    )
    jobs = tmp_path / ".spswap"
    Spool(jobs / "932").create()
    assert no_state_dir_text(jobs) == (
        f"{jobs} holds the state directory of job 932: give it ({jobs}/932), or ask with --job 932"
    )
    for job in ("932", "940"):
        Spool(jobs / job).create()
    (jobs / "941").mkdir()  # no spool: not named
    assert no_state_dir_text(jobs) == (
        f"{jobs} holds the state directories of jobs 932, 940: give one of them ({jobs}/932, "
        f"{jobs}/940), or ask with --job JOB_ID"
    )


def test_ask_needs_exactly_one_target() -> None:
    both = subprocess.run([sys.executable, "-m", "spswap.cli", "ask", "1", "--job", "3",
                           "--socket", "/tmp/x.sock"], capture_output=True, text=True)  # fmt: skip
    assert both.returncode != 0 and "give only one of --socket, --job" in both.stderr
    none = subprocess.run([sys.executable, "-m", "spswap.cli", "ask", "1"],
                          capture_output=True, text=True)  # fmt: skip
    assert none.returncode != 0 and "give one of --socket, --job or --state-dir" in none.stderr
    nothing = subprocess.run([sys.executable, "-m", "spswap.cli", "ask", "--job", "3"],
                             capture_output=True, text=True)  # fmt: skip
    assert nothing.returncode != 0 and "give the prompt's token ids (e.g. 1,2,3), or --id ID " \
        "alone" in " ".join(nothing.stderr.replace("│", " ").split()), nothing.stderr  # fmt: skip


def test_an_ended_job_gives_back_its_answers_and_takes_no_new_request(tmp_path: Path) -> None:
    # `spswap ask --job N` after job N COMPLETED: a new request waited 600 s for a run
    # that never comes (newcomer walk); an answer it gave stays readable by its id
    from spswap.serve.spool import Request

    spool = Spool(tmp_path / "state")
    spool.create()
    spool.complete(Request.from_json({"id": "q1", "prompt_ids": [1], "max_new_tokens": 2}),
                   [7, 8])  # fmt: skip
    old = ask_spool(spool.state_dir, {"id": "q1", "prompt_ids": [1], "max_new_tokens": 2},
                    timeout_s=5, ended="COMPLETED")  # fmt: skip
    assert old["ok"] and old["output_ids"] == [7, 8]
    t0 = time.monotonic()
    with pytest.raises(SpswapError, match=r"has ended \(COMPLETED\) and will not run again"):
        ask_spool(spool.state_dir, {"id": "q2", "prompt_ids": [1], "max_new_tokens": 2},
                  timeout_s=600, ended="COMPLETED")  # fmt: skip
    assert time.monotonic() - t0 < 5 and list(spool.inbox.iterdir()) == []


@pytest.mark.parametrize("state", ["RUNNING", "PENDING"])
def test_ask_by_job_waits_for_a_running_jobs_spool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state: str
) -> None:
    """Slurm says R a few seconds before the job's server makes its spool: `spswap ask
    --job N` waits for it then (a newcomer's first ask failed there); a job that does not
    run yet is told at once. (Slurm's answer is a stand-in here; tests/slurm's user-guide
    test asks the real one as soon as it says RUNNING.)"""
    import threading

    from spswap.serve import spool_ask
    from spswap.slurm.parse import JobInfo

    class Backend:
        def job(self, job_id: str) -> JobInfo:
            return JobInfo(job_id=job_id, state=state, work_dir=str(tmp_path))

    monkeypatch.setattr(spool_ask, "CliBackend", Backend)
    path = state_dir_of(str(tmp_path), "42")
    timer = threading.Timer(0.3, lambda: Spool(path).create())
    if state == "RUNNING":  # (a late call must not find it made for a job not running)
        timer.start()
    try:
        if state == "RUNNING":
            assert spool_ask.job_state_dir("42", spool_wait_s=30) == (path, None)
        else:
            with pytest.raises(SpswapError, match=r"has no spool \(inbox/, outbox/\): the job's "
                               r"server "
                               r"has not started yet \(its log says 'requests on'"):  # fmt: skip
                spool_ask.job_state_dir("42", spool_wait_s=30)
    finally:
        timer.cancel()


def test_ask_by_job_waits_for_both_boxes_of_a_spool_being_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server makes inbox/ then outbox/: an ask between the two was refused as "no
    spool" (CI, the user guide's test as a second uid, 2026-12-07)."""
    import threading

    from spswap.serve import spool_ask
    from spswap.slurm.parse import JobInfo

    class Backend:
        def job(self, job_id: str) -> JobInfo:
            return JobInfo(job_id=job_id, state="RUNNING", work_dir=str(tmp_path))

    monkeypatch.setattr(spool_ask, "CliBackend", Backend)
    path = state_dir_of(str(tmp_path), "42")
    (path / "inbox").mkdir(parents=True)
    timer = threading.Timer(0.3, lambda: (path / "outbox").mkdir())
    timer.start()
    try:
        assert spool_ask.job_state_dir("42", spool_wait_s=30) == (path, None)
        assert (path / "outbox").is_dir()
    finally:
        timer.cancel()


def test_ask_by_job_says_a_job_that_ended_without_a_spool_never_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A walk asked a job that had FAILED at its start (a template's MODEL= line left as
    it was) and was told its server "has not started yet": it never will. The job's end
    and where its log is are said instead, at once."""
    from spswap.serve import spool_ask
    from spswap.slurm.parse import JobInfo

    class Backend:
        def job(self, job_id: str) -> JobInfo:
            return JobInfo(
                job_id=job_id,
                state="FAILED",
                work_dir=str(tmp_path),
                std_out=str(tmp_path / "serve-42.log"),
            )

    monkeypatch.setattr(spool_ask, "CliBackend", Backend)
    t0 = time.monotonic()
    with pytest.raises(SpswapError) as e:
        spool_ask.job_state_dir("42", spool_wait_s=30)
    assert str(e.value) == (
        f"job 42 has ended (FAILED) without serving: {tmp_path}/.spswap/42 was never made "
        "(it was not a serving job, or its server never started: the job's log says why: "
        f"{tmp_path}/serve-42.log), or its state directory is elsewhere: give --state-dir"
    )
    assert time.monotonic() - t0 < 5


def test_no_spool_text_says_what_each_case_is() -> None:
    """A review: a vLLM job (no spool ever) that ended was told its server never
    started; a state directory elsewhere lost its --state-dir hint."""
    from spswap.serve.spool_ask import no_spool_text

    p = Path("/w/.spswap/7")
    said = {k: no_spool_text("7", p, **kw) for k, kw in {
        "made_ended": dict(ended="CANCELLED", made=True, waited_s=None, log="/w/j-7.log"),
        "running": dict(ended=None, made=False, waited_s=60.0, log=None),
    }.items()}  # fmt: skip
    assert said == {
        "made_ended": "job 7 has ended (CANCELLED) and /w/.spswap/7 has no spool (inbox/, "
        "outbox/): the job's log says why: /w/j-7.log, or its state directory is elsewhere: "
        "give --state-dir",
        "running": "/w/.spswap/7 has no spool (inbox/, outbox/) (60 s after the job ran): the "
        "job's server has not started yet (its log says 'requests on' once it has), or its "
        "state directory is elsewhere: give --state-dir",
    }


def test_a_vllm_jobs_state_directory_names_its_socket_by_job_and_by_state_dir(
    tmp_path: Path,
) -> None:
    """A one-model vLLM job has no spool: `spswap ask --job N` said so, but `--state-dir`
    on the same directory said "is it the state directory of a serving job?" (a review,
    2026-12-07)."""
    from spswap.serve.spool_ask import not_a_spool

    (tmp_path / "endpoint.json").write_text('{"uds": "/x/vllm.sock"}')
    cases = {"state_dir": (), "job": (None, "7"), "ended": ("COMPLETED", "7")}
    assert {k: not_a_spool(tmp_path, *a) for k, a in cases.items()} == {
        "state_dir": "this job serves vLLM's OpenAI API (spswap serve --engine vllm), which "
        f"has no spool: ask it on its socket, which {tmp_path}/endpoint.json names "
        "(docs/slurm.md)",
        "job": "job 7 serves vLLM's OpenAI API (spswap serve --engine vllm), which has no "
        f"spool: ask it on its socket, which {tmp_path}/endpoint.json names (docs/slurm.md)",
        "ended": "job 7 served vLLM's OpenAI API (spswap serve --engine vllm), which has no "
        "spool, and has ended (COMPLETED): nothing answers for it any more",
    }
    with pytest.raises(SpswapError, match="^this job serves vLLM's OpenAI API"):
        ask_spool(tmp_path, {"prompt_ids": [1]}, timeout_s=1)
    # parked or dumped (its endpoint.json removed until a run has it answering): its log
    # says it is a vLLM job; it was told "the job's server has not started yet (its log
    # says 'requests on' once it has)", which a vLLM server's log never says (a review)
    (tmp_path / "endpoint.json").unlink()
    assert not_a_spool(tmp_path) is None
    (tmp_path / "vllm.log").write_text("")
    assert not_a_spool(tmp_path, None, "7") == (
        "job 7 serves vLLM's OpenAI API (spswap serve --engine vllm), which has no spool: ask "
        f"it on its socket, which {tmp_path}/endpoint.json names once it answers: not now (it "
        "is starting, or was stopped and waits for its next run; its log: "
        f"{tmp_path}/vllm.log) (docs/slurm.md)"
    )
