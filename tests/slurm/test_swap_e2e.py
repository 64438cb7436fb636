"""The whole swap on a REAL Slurm: two jobs, one GPU slot, preemption and requeue.

A low-priority batch job serves model A from the sbatch template spswap ships; a
high-priority job for model B preempts it. A gets USR1, saves its unanswered requests,
puts its model away, releases its slot and is requeued; B waits for the slot, serves and
ends; A runs again with restart count 1 and answers the rest. Every answer must equal
the model's cold greedy answer, and no slot may leak. SPSWAP_TEST_SLURM=1 to run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spswap.serve.sbatch import SbatchOptions, render_serve
from spswap.slots.table import SlotTable
from tests.slurm.cluster import node_setting
from tests.slurm.conftest import SlurmCluster, wait_for

torch = pytest.importorskip("torch")
from spswap.engines.reference import save_checkpoint  # noqa: E402
from spswap.engines.reference_model import preset  # noqa: E402
from tests.helpers.reference import cold_answers  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
MAX_NEW = 12


def _requests(path: Path, prefix: str, n: int) -> list[list[int]]:
    prompts = [[3 + i, 9, 2 * i + 1, 5] for i in range(n)]
    path.write_text(
        "".join(
            json.dumps({"id": f"{prefix}{i:02d}", "prompt_ids": p, "max_new_tokens": MAX_NEW})
            + "\n"
            for i, p in enumerate(prompts)
        )
    )
    return prompts


def _submit(cluster: SlurmCluster, script: str, name: str) -> str:
    path = cluster.work / f"{name}.sbatch"
    path.write_text(script)
    env = dict(
        os.environ,
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        SPSWAP_ROOT=str(cluster.spswap_root),
    )
    out = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={cluster.work}", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return out.stdout.strip().split(";")[0]


def _answers(state: Path) -> dict[str, dict]:
    outbox = state / "outbox"
    if not outbox.is_dir():
        return {}
    return {p.stem: json.loads(p.read_text()) for p in outbox.glob("*.json")}


def _criu_usable() -> bool:
    from tests.checkpoint.criu_helpers import criu_skip_reason

    return criu_skip_reason() is None  # present, new enough, and `criu check` passes


KILL_WAIT_S = 5.0


def _assert_swapped(log: str, signal_name: str) -> None:
    """With CRIU the requeued run restores the dumped process; without, it starts from the
    pool and the first run's summary names the signal that stopped it."""
    if _criu_usable():
        # kept alive after its dump (under proctrack/cgroup), else from its image
        kept = "restored from its kept instance" in log
        how = "from its kept instance (no CRIU restore)" if kept else "from its image"
        assert f"restored {how} as pid" in log and f"restored {how} into run 1" in log, log
    else:
        assert f"stopped by {signal_name}" in log, log


def _assert_parked(cluster: SlurmCluster, job: str, *, early_requeue: bool) -> None:
    """spswapd moved the dumped tree out of the job's cgroup before the dump; on USR1 it
    requeued the job while the dump ran (the next job could start meanwhile); the dumped
    tree was kept alive, frozen, and came back into the new run's cgroup."""
    from spswap.config import Config
    from spswap.daemon import events

    log = [e for e in events.tail(Config.from_env({}, root=cluster.spswap_root).paths.events,
                                  500) if e.get("job_id") == job]  # fmt: skip
    kinds = [e["kind"] for e in log]
    assert "checkpoint.parked" in kinds and "restore.joined_job" in kinds, kinds
    # kept alive (frozen, parked) between the dump and the next run: no CRIU restore
    assert "checkpoint.kept" in kinds, kinds
    assert log[kinds.index("restore.done")]["detail"]["kept"] is True, kinds
    # each run's `spswap serve` told spswapd it starts, before it loaded its own code
    starts = [i for i, k in enumerate(kinds) if k == "job.starting"]
    assert [log[i]["detail"]["restart_count"] for i in starts] == [0, 1], kinds
    assert starts[1] < kinds.index("restore.done"), kinds
    saved = kinds.index("checkpoint.saved")
    assert kinds.index("checkpoint.parked") < saved, kinds
    parked = log[kinds.index("checkpoint.parked")]["detail"]["cgroups"]
    assert parked and not any(Path(p).exists() for p in parked), parked  # removed after
    # the run ended once its tree had left the job, not at KillWait's SIGKILL (5 s in
    # scripts/slurm_up.sh's slurm.conf): a kept tree never exits (spswap.serve.run_watch)
    # (from the requeue, Slurm's stop signal, where it came after the park: a requeue once
    # the image is complete waits for the dump, seconds on a loaded machine)
    parked_i = kinds.index("checkpoint.parked")
    end_i = next(i for i in range(parked_i, len(kinds)) if kinds[i] == "job.end")
    stops = ("checkpoint.parked", "job.requeue", "job.requeue_refused")
    since_i = max(i for i in range(parked_i, end_i) if kinds[i] in stops)
    waited_s = log[end_i]["ts"] - log[since_i]["ts"]
    assert waited_s < KILL_WAIT_S, f"the job ended {waited_s:.1f} s after {kinds[since_i]}: {kinds}"
    if early_requeue:
        requeue = kinds.index("job.requeue")
        assert requeue < saved and log[requeue]["detail"]["early"] is True, kinds


def _job_log(cluster: SlurmCluster, name: str, job: str) -> str:
    path = cluster.work / f"{name}-{job}.log"
    return path.read_text() if path.exists() else "(no log)"


def test_preempted_job_resumes_its_requests_and_answers_like_cold(
    slurm_cluster: SlurmCluster,
) -> None:
    work = slurm_cluster.work
    model_a, model_b = work / "model-a", work / "model-b"
    save_checkpoint(preset("small"), model_a)
    save_checkpoint(preset("tiny", seed=7), model_b)
    # A serves (no exit when idle) many requests: on any machine preemption comes before
    # it is done; B has a few and exits when idle
    prompts_a = _requests(work / "a.jsonl", "a", 48)
    prompts_b = _requests(work / "b.jsonl", "b", 4)

    low = _submit(
        slurm_cluster,
        render_serve(
            SbatchOptions(
                model=str(model_a),
                job_name="swap-low",
                partition="low",
                gpus=2,
                requests=str(work / "a.jsonl"),
                time_limit="00:20:00",
            )
        ).replace(" --exit-when-idle", ""),
        "swap-low",
    )
    state_a = work / ".spswap" / low
    wait_for("job A's first answers", lambda: len(_answers(state_a)) >= 2, timeout_s=120)

    high = _submit(
        slurm_cluster,
        render_serve(
            SbatchOptions(
                model=str(model_b),
                job_name="swap-high",
                partition="high",
                gpus=1,
                requests=str(work / "b.jsonl"),
                time_limit="00:20:00",
            )
        ),
        "swap-high",
    )
    state_b = work / ".spswap" / high
    wait_for("job B's answers", lambda: len(_answers(state_b)) == len(prompts_b), timeout_s=120)
    wait_for(
        "job A's requeued run to finish every request",
        lambda: len(_answers(state_a)) == len(prompts_a),
        timeout_s=180,
    )

    log_a = _job_log(slurm_cluster, "swap-low", low)
    answers_a, answers_b = _answers(state_a), _answers(state_b)
    runs = sorted({a["restart_count"] for a in answers_a.values()})
    assert runs == [0, 1], f"A must answer in both runs; log:\n{log_a}"
    _assert_swapped(log_a, "SIGUSR1")
    assert [answers_a[f"a{i:02d}"]["output_ids"] for i in range(len(prompts_a))] == cold_answers(
        model_a, prompts_a, MAX_NEW
    )
    assert [answers_b[f"b{i:02d}"]["output_ids"] for i in range(len(prompts_b))] == cold_answers(
        model_b, prompts_b, MAX_NEW
    )
    assert not list((state_a / "inbox").glob("*.json"))
    from spswap.slurm.backend import CliBackend

    CliBackend().cancel(low)  # A serves on until told; its slot must come back
    table = SlotTable(slurm_cluster.spswap_root / "slots", [0, 1])
    wait_for("every slot released", lambda: table.reservations() == [], timeout_s=60)


def _serving_job(
    cluster: SlurmCluster,
    name: str,
    n: int,
    *,
    exit_when_idle: bool = True,
    no_requeue: bool = False,
) -> tuple[str, Path, Path, list[list[int]]]:
    work = cluster.work
    model = work / f"model-{name}"
    if not model.exists():
        save_checkpoint(preset("small"), model)
    prompts = _requests(work / f"{name}.jsonl", name, n)
    script = render_serve(
        SbatchOptions(
            model=str(model),
            job_name=name,
            partition="debug",
            gpus=1,
            requests=str(work / f"{name}.jsonl"),
            time_limit="00:20:00",
        )
    )
    if not exit_when_idle:
        script = script.replace(" --exit-when-idle", "")
    if no_requeue:
        assert "#SBATCH --requeue\n" in script
        script = script.replace("#SBATCH --requeue\n", "#SBATCH --no-requeue\n")
    job = _submit(cluster, script, name)
    return job, work / ".spswap" / job, model, prompts


@pytest.mark.parametrize("how", ["scontrol-requeue", "scancel-usr1-batch"])
def test_requeue_and_usr1_take_the_same_path(slurm_cluster: SlurmCluster, how: str) -> None:
    from spswap.slurm.backend import CliBackend

    backend = CliBackend()
    job, state, model, prompts = _serving_job(slurm_cluster, f"rq-{how}", 16)
    wait_for("the first answers", lambda: len(_answers(state)) >= 2, timeout_s=120)
    if how == "scontrol-requeue":
        backend.requeue(job)
    else:
        backend.signal_batch(job, "USR1")
    wait_for("every request answered", lambda: len(_answers(state)) == len(prompts), timeout_s=180)
    log = _job_log(slurm_cluster, f"rq-{how}", job)
    answers = _answers(state)
    assert sorted({a["restart_count"] for a in answers.values()}) == [0, 1], log
    _assert_swapped(log, "SIGTERM" if how == "scontrol-requeue" else "SIGUSR1")
    assert "not requeueable" not in log, log  # the template's --requeue: no warning
    if _criu_usable() and slurm_cluster.proctrack == "cgroup":
        _assert_parked(slurm_cluster, job, early_requeue=how != "scontrol-requeue")
    assert [answers[f"rq-{how}{i:02d}"]["output_ids"] for i in range(len(prompts))] == cold_answers(
        model, prompts, MAX_NEW
    )
    table = SlotTable(slurm_cluster.spswap_root / "slots", [0, 1])
    wait_for("every slot released", lambda: table.reservations() == [], timeout_s=30)


def test_sigkilled_server_leaves_no_reservation_behind(slurm_cluster: SlurmCluster) -> None:
    from spswap.slurm.backend import CliBackend

    job, state, _model, _prompts = _serving_job(slurm_cluster, "killed", 4, exit_when_idle=False)
    table = SlotTable(slurm_cluster.spswap_root / "slots", [0, 1])
    held = wait_for(
        "the job's reservation",
        lambda: [r for r in table.reservations() if r.holder.job_id == job],
        timeout_s=120,
    )
    wait_for("its answers", lambda: len(_answers(state)) == 4, timeout_s=120)
    os.kill(held[0].holder.pid, 9)  # no handler runs, nothing is released by the job
    wait_for(
        "the reservation reclaimed",
        lambda: not [r for r in table.reservations() if r.holder.job_id == job],
        timeout_s=60,
    )
    backend = CliBackend()
    wait_for("the job to end", lambda: backend.job_alive(job) is False, timeout_s=60)
    # the GPU is usable again: a new reservation on it is granted at once
    gpu = held[0].gpus[0]
    res = table.reserve(model="next", units=4, allowed_gpus=[gpu], timeout_s=5)
    table.release(res.id)


def test_a_dump_that_fails_after_the_early_requeue_ends_the_instance(
    slurm_cluster: SlurmCluster,
    tmp_path: Path,
) -> None:
    """USR1, the tree parked outside its job and the job requeued at once, then CRIU
    fails (the images' tmpfs is full): the instance cannot go back into a job that is
    gone, so it is ended, and the requeued run starts from the pool and answers every
    saved request as the cold model would."""
    from spswap.config import Config
    from spswap.daemon import events
    from spswap.slurm.backend import CliBackend

    if not _criu_usable() or slurm_cluster.proctrack != "cgroup":
        pytest.skip("needs CRIU and proctrack/cgroup (a tree parked outside its job)")
    images = Config.from_env({}, root=slurm_cluster.spswap_root).paths.images
    images.mkdir(mode=0o700, exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M,mode=0700", "tmpfs",
                            str(images)], capture_output=True, text=True)  # fmt: skip
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        job, state, model, prompts = _serving_job(slurm_cluster, "early-fail", 16)
        wait_for("the first answers", lambda: len(_answers(state)) >= 2, timeout_s=120)
        CliBackend().signal_batch(job, "USR1")
        wait_for(
            "every request answered", lambda: len(_answers(state)) == len(prompts), timeout_s=240
        )
    finally:
        subprocess.run(["umount", "-l", str(images)], check=False)
    log = [e for e in events.tail(Config.from_env({}, root=slurm_cluster.spswap_root)
                                  .paths.events, 500) if e.get("job_id") == job]  # fmt: skip
    kinds = [e["kind"] for e in log]
    requeue = log[kinds.index("job.requeue")]
    failed = log[kinds.index("checkpoint.failed")]
    assert requeue["detail"]["early"] is True and kinds.index("job.requeue") < kinds.index(
        "checkpoint.failed"
    ), kinds
    assert "the instance was ended" in failed["detail"]["reason"], failed
    answers = _answers(state)
    assert sorted({a["restart_count"] for a in answers.values()}) == [0, 1]
    assert [
        answers[f"early-fail{i:02d}"]["output_ids"] for i in range(len(prompts))
    ] == cold_answers(model, prompts, MAX_NEW)


def test_scancel_does_not_checkpoint_a_job_that_will_not_come_back(
    slurm_cluster: SlurmCluster,
) -> None:
    """SIGTERM from scancel: Slurm says CANCELLED, so the server does not ask spswapd for
    a dump that nothing would restore (before: every SIGTERM dumped); it ends cleanly."""
    from spswap.config import Config
    from spswap.daemon import events
    from spswap.slurm.backend import CliBackend

    if not _criu_usable():
        pytest.skip("without CRIU nothing is dumped anyway")
    job, state, _model, _prompts = _serving_job(slurm_cluster, "cancelled", 4,
                                                exit_when_idle=False)  # fmt: skip
    wait_for("its answers", lambda: len(_answers(state)) == 4, timeout_s=120)
    backend = CliBackend()
    backend.cancel(job)
    wait_for("the job to end", lambda: backend.job_alive(job) is False, timeout_s=60)
    wait_for("the server's last words", lambda: "answered 4" in _job_log(
        slurm_cluster, "cancelled", job), timeout_s=30)  # fmt: skip
    log = _job_log(slurm_cluster, "cancelled", job)
    assert f"not checkpointed: job {job} is " in log and "not requeued" in log, log
    kinds = [e["kind"] for e in events.tail(
        Config.from_env({}, root=slurm_cluster.spswap_root).paths.events, 500)
        if e.get("job_id") == job]  # fmt: skip
    assert "checkpoint.start" not in kinds, kinds


def test_ask_by_job_id_from_outside_the_job(slurm_cluster: SlurmCluster) -> None:
    """The user guide's way in: the template's server asked by `spswap ask --job N` from
    the login node (here, the test process), answered as the cold model answers."""
    job, state, model, _prompts = _serving_job(slurm_cluster, "askjob", 1,
                                               exit_when_idle=False)  # fmt: skip
    try:
        wait_for("its first answer", lambda: len(_answers(state)) == 1, timeout_s=120)
        env = dict(os.environ, SPSWAP_ROOT=str(slurm_cluster.spswap_root))
        out = subprocess.run([slurm_cluster.spswap_bin, "ask", "7,8,9", "--max-new-tokens",
                              str(MAX_NEW), "--job", job], env=env, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr
        (want,) = cold_answers(model, [[7, 8, 9]], MAX_NEW)
        assert out.stdout.strip() == ",".join(map(str, want))
    finally:
        from spswap.slurm.backend import CliBackend

        CliBackend().cancel(job)


def test_a_job_that_cannot_come_back_is_warned_at_its_start(slurm_cluster: SlurmCluster) -> None:
    """--no-requeue: the job log says at the start that a preemption would end the job for
    good (issue 15 item 8; before, nothing until "requeue request refused" at preemption);
    preemption's USR1 then checkpoints nothing (before, a whole image was dumped for a
    next run Slurm would never start, and the log promised one)."""
    from spswap.config import Config
    from spswap.daemon import events
    from spswap.errors import SlurmCommandError
    from spswap.slurm.backend import CliBackend

    name = "norequeue"
    job, state, _model, _prompts = _serving_job(slurm_cluster, name, 2, exit_when_idle=False,
                                                no_requeue=True)  # fmt: skip
    wait_for("its answers", lambda: len(_answers(state)) == 2, timeout_s=120)
    backend = CliBackend()
    with pytest.raises(SlurmCommandError, match=f"Slurm may not requeue job {job} "):
        backend.requeue(job)  # what spswapd's event says when it is refused
    backend.signal_batch(job, "USR1")  # as preemption's GraceTime signal
    wait_for("the job to end", lambda: backend.job_alive(job) is False, timeout_s=60)
    log = _job_log(slurm_cluster, name, job)
    assert f"warning: job {job} is not requeueable (Slurm shows Requeue=0" in log, log
    assert f"not checkpointed: job {job} is not requeueable" in log, log
    assert "handed to spswapd" not in log, log
    kinds = [e["kind"] for e in events.tail(
        Config.from_env({}, root=slurm_cluster.spswap_root).paths.events, 500)
        if e.get("job_id") == job]  # fmt: skip
    assert "checkpoint.start" not in kinds, kinds


def test_a_requeue_while_a_long_request_runs_loses_nothing(slurm_cluster: SlurmCluster) -> None:
    """`scontrol requeue` of a batch job in the middle of a long answer: the drain is cut
    to fit KillWait (5 s here), the unfinished request is saved and the model put away
    before Slurm's SIGKILL, and the next run answers every request as the cold model
    would. (With a drain as long as KillWait the job was killed first: the request was
    quarantined as "a crash or a kill" and the run started cold.)"""
    from spswap.slurm.backend import CliBackend

    long_new = 220  # the small preset's 256 positions, less the prompt
    work = slurm_cluster.work
    model = work / "model-long"
    if not model.exists():
        save_checkpoint(preset("small"), model)
    # two: the first answered, the second cut by the requeue (more only cost CI time)
    prompts = [[3 + i, 9, 2 * i + 1, 5] for i in range(2)]
    (work / "long.jsonl").write_text("".join(
        json.dumps({"id": f"long{i}", "prompt_ids": p, "max_new_tokens": long_new}) + "\n"
        for i, p in enumerate(prompts)))  # fmt: skip
    script = render_serve(SbatchOptions(model=str(model), job_name="long", partition="debug",
                                        gpus=1, requests=str(work / "long.jsonl"),
                                        time_limit="00:20:00"))  # fmt: skip
    job = _submit(slurm_cluster, script, "long")
    state = work / ".spswap" / job
    wait_for("the first long answer", lambda: len(_answers(state)) >= 1, timeout_s=180)
    CliBackend().requeue(job)  # the second request is being answered now
    wait_for("every long request answered", lambda: len(_answers(state)) == len(prompts),
             timeout_s=300)  # fmt: skip
    log = _job_log(slurm_cluster, "long", job)
    answers = _answers(state)
    assert all(a.get("ok", True) and "output_ids" in a for a in answers.values()), answers
    assert "cut to 3 s" in log and "quarantined" not in log, log
    assert [answers[f"long{i}"]["output_ids"] for i in range(len(prompts))] == cold_answers(
        model, prompts, long_new
    ), log


def test_with_no_keep_the_requeued_run_takes_its_image_restored_at_its_prolog(
    slurm_cluster: SlurmCluster,
) -> None:
    """SPSWAP_KEEP_BYTES=0: the dumped tree is not kept, but its parked cgroup is; the
    requeued run's prolog has spswapd restore the image into it before the run asks, and
    the run takes it as restored from its image (CRIU's restore off the run's path)."""
    from spswap.config import Config
    from spswap.daemon import events
    from spswap.slurm.backend import CliBackend

    if not _criu_usable() or slurm_cluster.proctrack != "cgroup":
        pytest.skip("needs CRIU and proctrack/cgroup (a tree parked outside its job)")
    with node_setting(slurm_cluster, "SPSWAP_KEEP_BYTES=0"):
        job, state, model, prompts = _serving_job(slurm_cluster, "early-img", 16)
        wait_for("the first answers", lambda: len(_answers(state)) >= 2, timeout_s=120)
        CliBackend().signal_batch(job, "USR1")
        wait_for("every request answered", lambda: len(_answers(state)) == len(prompts),
                 timeout_s=240)  # fmt: skip
        CliBackend().cancel(job)
    log = [e for e in events.tail(Config.from_env({}, root=slurm_cluster.spswap_root)
                                  .paths.events, 500) if e.get("job_id") == job]  # fmt: skip
    kinds = [e["kind"] for e in log]
    assert "checkpoint.kept" not in kinds and "restore.restored_early" in kinds, kinds
    restart = next(i for i, e in enumerate(log)
                   if e["kind"] == "job.start" and e["detail"]["restart_count"] == 1)  # fmt: skip
    assert restart < kinds.index("restore.restored_early") < kinds.index("restore.done"), kinds
    done = log[kinds.index("restore.done")]["detail"]
    assert done["kept"] is False and "early_criu_restore" in done["timings_s"], done
    text = _job_log(slurm_cluster, "early-img", job)
    assert "restored from its image as pid" in text, text
    answers = _answers(state)
    assert sorted({a["restart_count"] for a in answers.values()}) == [0, 1], text
    assert [answers[f"early-img{i:02d}"]["output_ids"] for i in range(len(prompts))] == \
        cold_answers(model, prompts, MAX_NEW)  # fmt: skip
