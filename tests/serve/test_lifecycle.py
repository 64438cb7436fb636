"""The serve lifecycle's restore decisions, through ServeRun with the real reference
backend and engine on CPU; spswapd's restore is played by tests/helpers/restore.py (the
real one, with CRIU: tests/checkpoint/test_faults.py and test_serve_vllm_criu.py; the
vLLM backend's same decision: tests/serve/test_vllm_serve.py, and on a GPU
tests/engines/test_vllm_serve_gpu.py).

A requeued run whose restored instance ends on its own with work left serves on from a
cold start (the pool) in the same run, saying why in its log and runs.jsonl, and ends
what the instance left running; one whose instance finished its work does not start an
engine; a refused restore starts cold with the reason."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from spswap.config import Config

torch = pytest.importorskip("torch")
from spswap.engines.reference import save_checkpoint  # noqa: E402
from spswap.engines.reference_model import preset  # noqa: E402
from spswap.serve.backend import ServeResult  # noqa: E402
from spswap.serve.factory import make_engine  # noqa: E402
from spswap.serve.run_log import RunPath, read_runs  # noqa: E402
from spswap.serve.runtime import ServeOptions, reference_run  # noqa: E402
from tests.helpers.reference import cold_answers  # noqa: E402
from tests.helpers.restore import DIES_LEAVING_A_CHILD, RestoreStandIn, running  # noqa: E402

MAX_NEW = 6
PROMPTS = [[3, 1, 4], [1, 5, 9, 2], [6, 5]]


def _run(tmp: Path, opts: ServeOptions, checkpointer: Any, *, job_id: str, restart_count: int,
         log: Any) -> Any:  # fmt: skip
    """A reference engine's run of job ``job_id`` whose spswapd ``checkpointer`` plays."""
    return reference_run(Config.from_env({}, root=tmp / "root"), opts,
                         engine_factory=make_engine, job_id=job_id,
                         restart_count=restart_count, checkpointer=checkpointer,
                         log=log)  # fmt: skip


def _requeued_run(tmp: Path, restore: RestoreStandIn, *, exit_when_idle: bool = True,
                  requests: bool = True) -> tuple[ServeResult, list[str]]:  # fmt: skip
    model = tmp / "model"
    if not model.exists():
        save_checkpoint(preset("tiny"), model)
    reqs = tmp / "req.jsonl"
    reqs.write_text("".join(json.dumps({"id": f"q{i}", "prompt_ids": p,
                                        "max_new_tokens": MAX_NEW}) + "\n"
                            for i, p in enumerate(PROMPTS)) if requests else "")  # fmt: skip
    opts = ServeOptions(model=model, state_dir=tmp / "state", requests_file=reqs,
                        exit_when_idle=exit_when_idle)  # fmt: skip
    logs: list[str] = []
    run = _run(tmp, opts, restore, job_id="77", restart_count=1, log=logs.append)
    try:
        return run.run(), logs
    finally:
        restore.kill()


def test_a_restored_instance_that_dies_with_work_left_is_replaced_by_a_cold_start(
    tmp_path: Path,
) -> None:
    restore = RestoreStandIn(DIES_LEAVING_A_CHILD)
    result, logs = _requeued_run(tmp_path, restore)
    child = int(restore.first_line)
    assert restore.restored and restore.restored[0]["restart_count"] == 1
    assert result.restored_pid == restore.proc.pid and result.stopped_by is None  # type: ignore[union-attr]
    reason = result.cold_reason
    assert reason is not None and reason.startswith(
        f"starts anew: the restored instance (pid {result.restored_pid}) ended on its own "
        f"({len(PROMPTS)} request(s) unanswered)"
    ), reason
    assert f"ended what it left running (pid {child})" in reason
    assert not running(child)  # it would have held what the cold start needs
    assert f"spswap serve: {reason}" in logs  # the job's log says why
    # served in the same run, as the cold model answers
    assert result.path in (RunPath.COLD, RunPath.POOL)
    assert (result.answered, result.pending_left) == (len(PROMPTS), 0)
    outbox = tmp_path / "state" / "outbox"
    answers = [json.loads((outbox / f"q{i}.json").read_text())["output_ids"]
               for i in range(len(PROMPTS))]  # fmt: skip
    assert answers == cold_answers(tmp_path / "model", PROMPTS, MAX_NEW)
    # runs.jsonl: the restore, then the cold start with its reason
    runs = read_runs(tmp_path / "state")
    assert [(r.restart_count, r.path, r.reason) for r in runs] == [
        (1, RunPath.IMAGE, None),
        (1, result.path, reason),
    ]


def test_a_restored_instance_that_finished_its_work_starts_nothing(tmp_path: Path) -> None:
    """exit_when_idle and nothing left in the spool: its end is the job's end."""
    restore = RestoreStandIn("print('up', flush=True)")
    result, logs = _requeued_run(tmp_path, restore, requests=False)
    assert result.restored_pid is not None and result.cold_reason is None
    assert result.path is None and result.answered == 0
    assert [r.path for r in read_runs(tmp_path / "state")] == [RunPath.IMAGE]


def test_a_refused_restore_starts_cold_and_says_why(tmp_path: Path) -> None:
    restore = RestoreStandIn(None, refuse="the image of job 77 was changed: not restored")
    result, logs = _requeued_run(tmp_path, restore)
    reason = "starts anew: the image of job 77 was changed: not restored"
    assert result.cold_reason == reason and f"spswap serve: {reason}" in logs
    assert result.restored_pid is None and result.answered == len(PROMPTS)
    assert [(r.path, r.reason) for r in read_runs(tmp_path / "state")] == [(result.path, reason)]


def test_the_log_says_cold_where_runs_jsonl_does(tmp_path: Path) -> None:
    """The first run reads the model into the pool: cold in its log as in runs.jsonl (its
    log said "up from the pool"); the next run is up from the pool in both. The same
    requests given again are not asked again, and the log says so (it said nothing)."""
    model = tmp_path / "model"
    save_checkpoint(preset("tiny"), model)
    cfg = Config.from_env({}, root=tmp_path / "root")
    reqs = tmp_path / "req.jsonl"
    reqs.write_text('{"id": "a", "prompt_ids": [1, 2], "max_new_tokens": 2}\n')
    said = []
    for restart in (0, 1):
        logs: list[str] = []
        opts = ServeOptions(model=model, state_dir=tmp_path / "state", exit_when_idle=True,
                            requests_file=reqs)  # fmt: skip
        run = reference_run(cfg, opts, engine_factory=make_engine, job_id=None,
                            restart_count=restart, log=logs.append)  # fmt: skip
        if restart:  # its own process, started after the first run made the pool entry
            run.started_s = time.time()
        result = run.run()
        up = [line for line in logs if " up " in line]
        said.append((result.path, up[0].split("; engine started in ")[0] if up else logs))
        again = [line for line in logs if "answered before" in line]
        assert (result.answered, again) == ((1, []) if not restart else (0, [
            f"spswap serve: of the 1 request(s) in {reqs}, 1 were answered before (answers in "
            f"{tmp_path / 'state' / 'outbox'}), 0 were saved by an earlier run for this one, 0 "
            "are new"]))  # fmt: skip
    assert said == [
        (RunPath.COLD, "spswap serve: model up (cold: read from its files into the pool by "
                       "this run, then loaded from it)"),
        (RunPath.POOL, "spswap serve: model up from the pool"),
    ]  # fmt: skip
    assert [r.path for r in read_runs(tmp_path / "state")] == [RunPath.COLD, RunPath.POOL]


def test_a_requests_file_line_that_reuses_an_id_with_another_prompt_is_not_asked(
    tmp_path: Path,
) -> None:
    """The id names one request: a second line with it and another prompt is logged and
    skipped, never answered with the first one's answer; the rest of the file is served."""
    model = tmp_path / "model"
    save_checkpoint(preset("tiny"), model)
    reqs = tmp_path / "req.jsonl"
    reqs.write_text('{"id": "a", "prompt_ids": [1, 2], "max_new_tokens": 2}\n'
                    '{"id": "a", "prompt_ids": [3], "max_new_tokens": 2}\n'
                    '{"id": "b", "prompt_ids": [4], "max_new_tokens": 2}\n')  # fmt: skip
    logs: list[str] = []
    opts = ServeOptions(model=model, state_dir=tmp_path / "state", exit_when_idle=True,
                        requests_file=reqs)  # fmt: skip
    result = reference_run(Config.from_env({}, root=tmp_path / "root"), opts,
                           engine_factory=make_engine, log=logs.append).run()  # fmt: skip
    assert result.answered == 2
    assert f"spswap serve: {reqs}:2: request a was asked before with the prompt 1,2 and 2 new " \
        "tokens: ask with that prompt (and --max-new-tokens) to get its answer, or use a new " \
        "--id; that line is not asked" in logs, logs  # fmt: skip
    assert not any("answered before" in line for line in logs), logs


class _ParkRestoredAtOnce:
    """Plays spswapd for a run's parks: the first is restored into run 1 at once (this
    process serves on), the next refused."""

    run_started_s = None

    def __init__(self) -> None:
        self.parks = 0

    def park(self, job_id: str, identity: dict[str, str], *, requeue: bool = False) -> Any:
        from spswap.daemon.statuses import CheckpointState
        from spswap.serve.checkpointer import ParkOutcome

        self.parks += 1
        if self.parks == 1:
            return ParkOutcome(CheckpointState.RESTORED, restart_count=1,
                               timings_s={"restore": 0.01})  # fmt: skip
        return ParkOutcome(CheckpointState.FAILED, reason="no second dump in this test")


@pytest.mark.parametrize("at_start", [True, False])
def test_the_check_s_answer_is_taken_at_the_start_not_on_the_stop_s_path(
    tmp_path: Path, at_start: bool
) -> None:
    """One model: its check prompt's answer is taken once, when it is first up, so a stop
    (the preempting job waits on it) asks nothing; a backend whose awake models change
    (multi-model) is asked at each stop. After the restore it is asked as before."""
    import signal
    import threading

    model = tmp_path / "model"
    save_checkpoint(preset("tiny"), model)
    opts = ServeOptions(model=model, state_dir=tmp_path / "state", exit_when_idle=False)
    checkpointer = _ParkRestoredAtOnce()
    run = _run(tmp_path, opts, checkpointer, job_id="78", restart_count=0, log=lambda _m: None)
    run.backend.probe_at_start = at_start  # type: ignore[misc]
    asked: list[tuple[str, Any, Any]] = []  # (when, like, answer) for each check prompt
    probe = run.backend.probe

    def recording(like: Any = None) -> Any:
        when = "stopping" if run.stop.stop_event.is_set() else "serving"
        answer = probe(like)
        asked.append((when, like, answer))
        return answer

    run.backend.probe = recording  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    th = threading.Thread(target=lambda: out.update(result=run.run()))
    th.start()
    try:
        for parks in (1, 2):  # preempted twice: restored at once, then refused
            deadline = time.monotonic() + 120
            while len(asked) < parks - int(not at_start) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
            run.handle_signal(signal.SIGUSR1, None)
            while checkpointer.parks < parks and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        th.join(120)
    assert asked[0][1] is None and asked[0][2] is not None  # asked plainly, answered
    assert asked[1][1] == asked[0][2]  # after the restore: asked as that answer was
    if at_start:  # at the start (serving), then only after the restore
        assert [w for w, _, _ in asked] == ["serving", "serving"]
    else:  # at each stop, and after the restore
        assert [w for w, _, _ in asked] == ["stopping", "serving", "stopping"]
    restored = [e for e in out["result"].events if e.get("restored")]
    assert restored and restored[0]["probed"] is True and "probe" not in restored[0]


class _ParkRefused:
    """Plays spswapd for a run's parks: each is refused (the run then ends)."""

    run_started_s = None

    def __init__(self) -> None:
        self.parks = 0

    def park(self, job_id: str, identity: dict[str, str], *, requeue: bool = False) -> Any:
        from spswap.daemon.statuses import CheckpointState
        from spswap.serve.checkpointer import ParkOutcome

        self.parks += 1
        return ParkOutcome(CheckpointState.FAILED, reason="refused in this test")


@pytest.mark.parametrize("flag", ["79 0", "79 1", "80 0", None])
def test_a_preemption_of_a_job_slurm_may_not_requeue_saves_nothing(
    tmp_path: Path, flag: str | None
) -> None:
    """Slurm said at the job's first run that it may not requeue it ("<job> 0" in the
    state directory's requeue file): preemption's USR1 neither checkpoints (Slurm ends
    the job: the image would never be used) nor asks for a requeue (Slurm refuses it).
    Requeue=1, no answer, or another job's file: both, as before."""
    import signal
    import threading

    from spswap.serve.checkpointer import REQUEUE_FILE

    model = tmp_path / "model"
    save_checkpoint(preset("tiny"), model)
    state = tmp_path / "state"
    state.mkdir()
    if flag is not None:
        (state / REQUEUE_FILE).write_text(flag + "\n")
    opts = ServeOptions(model=model, state_dir=state, exit_when_idle=False)
    checkpointer: Any = _ParkRefused()
    logs: list[str] = []
    requeued: list[str] = []
    run = reference_run(Config.from_env({}, root=tmp_path / "root"), opts,
                        engine_factory=make_engine, job_id="79", checkpointer=checkpointer,
                        requeue=requeued.append, log=logs.append)  # fmt: skip
    th = threading.Thread(target=run.run)
    th.start()
    try:
        deadline = time.monotonic() + 120
        while not any(" up " in line for line in logs) and time.monotonic() < deadline:
            time.sleep(0.05)  # ("... up from its files in ...": serving)
        time.sleep(0.3)
        run.handle_signal(signal.SIGUSR1, None)
    finally:
        th.join(120)
    assert not th.is_alive()
    text = "\n".join(logs)
    if flag == "79 0":
        assert checkpointer.parks == 0 and requeued == [], text
        assert "not checkpointed: job 79 is not requeueable" in text, text
    else:
        assert checkpointer.parks == 1 and requeued == ["79"], text
        assert "not requeueable" not in text, text
