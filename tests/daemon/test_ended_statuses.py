"""An ended job's checkpoint status: what `spswap status` shows once the job will not come
back (job_ops.collect_images at a prolog, job.end with the job gone)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spswap.config import Config
from spswap.daemon import lifecycle
from spswap.daemon.job_ops import collect_images
from spswap.daemon.state import DaemonState
from spswap.daemon.statuses import CheckpointState, CheckpointStatuses
from spswap.slurm.parse import JobInfo


@pytest.mark.parametrize(("before", "images_deleted", "after"), [
    (CheckpointState.RESTORED, False, CheckpointState.DELETED),  # its image went at the restore
    (CheckpointState.SAVED, True, CheckpointState.DELETED),
    (CheckpointState.DUMPING, True, CheckpointState.DELETED),
    (CheckpointState.SAVED, False, CheckpointState.SAVED),  # no image deleted: as it was
    (CheckpointState.FAILED, True, CheckpointState.FAILED),  # keeps why it started cold
    (CheckpointState.REJECTED, False, CheckpointState.REJECTED),
])  # fmt: skip
def test_a_gone_job_says_deleted_where_it_still_said_image_or_restored(
    tmp_path: Path, before: CheckpointState, images_deleted: bool, after: CheckpointState
) -> None:
    statuses = CheckpointStatuses(tmp_path)
    statuses.write("5", state=before, reason="earlier")
    statuses.mark_gone("5", "the job ended (CANCELLED)", images_deleted=images_deleted)
    status = statuses.read("5")
    assert status["state"] == after
    assert status["reason"] == ("the job ended (CANCELLED)" if after != before else "earlier")


def test_a_status_keeps_its_jobs_owner_through_every_state(tmp_path: Path) -> None:
    """The walk: a deleted (or failed) status had lost its job's uid, so `spswap status`
    could not say whose it was; a job does not change hands."""
    statuses = CheckpointStatuses(tmp_path)
    statuses.write("5", state=CheckpointState.DUMPING, pid=9, uid=1001)
    statuses.write("5", state=CheckpointState.SAVED, pid=9)
    statuses.mark_gone("5", "the job ended (CANCELLED)", images_deleted=True)
    assert statuses.read("5") == {"job_id": "5", "state": CheckpointState.DELETED,
                                  "reason": "the job ended (CANCELLED)", "uid": 1001}  # fmt: skip
    statuses.write("6", state=CheckpointState.FAILED, reason="r")  # none known: none made up
    assert "uid" not in statuses.read("6")


def test_jobs_in_lists_the_jobs_of_one_state(tmp_path: Path) -> None:
    statuses = CheckpointStatuses(tmp_path / "none")
    assert statuses.jobs_in(CheckpointState.RESTORED) == []
    statuses = CheckpointStatuses(tmp_path)
    statuses.write("12+0", state=CheckpointState.RESTORED)
    statuses.write("13", state=CheckpointState.SAVED)
    assert statuses.jobs_in(CheckpointState.RESTORED) == ["12+0"]


def _state(tmp_path: Path, slurm: dict[str, str | None]) -> DaemonState:
    cfg = Config.from_env({}, root=tmp_path / "root")
    lifecycle.prepare_dirs(cfg)
    st = DaemonState(cfg)

    def ask_slurm(job_id: str) -> tuple[JobInfo | None, bool]:
        state = slurm.get(job_id)
        return (JobInfo(job_id=job_id, state=state) if state else None), True

    st.ask_slurm = ask_slurm  # type: ignore[method-assign]
    return st


def _slurm_says(st: DaemonState, state: str, *, restart_count: int) -> list[str]:
    """Slurm answers ``state`` and ``restart_count`` for every job; the jobs asked about,
    in order (the epilog is on the next job's path: each ask counts)."""
    asked: list[str] = []

    def ask_slurm(job_id: str) -> tuple[JobInfo | None, bool]:
        asked.append(job_id)
        return JobInfo(job_id=job_id, state=state, restart_count=restart_count), True

    st.ask_slurm = ask_slurm  # type: ignore[method-assign]
    return asked


def test_a_cancelled_jobs_restored_status_does_not_stay_restored(tmp_path: Path) -> None:
    st = _state(tmp_path, {"7": "CANCELLED", "8": "RUNNING", "9": None})
    for job in ("7", "8", "9", "10"):
        st.statuses.write(job, state=CheckpointState.RESTORED, pid=1)
    # 7 was scancel'ed for good, 8 still runs, Slurm no longer knows 9, 10 is the prolog's
    assert collect_images(st, "10") == ["7", "9"]
    assert st.statuses.read("7")["state"] == CheckpointState.DELETED
    assert st.statuses.read("7")["reason"] == "the job ended (CANCELLED)"
    assert st.statuses.read("9")["reason"] == "Slurm no longer knows the job"
    assert st.statuses.read("8")["state"] == CheckpointState.RESTORED
    assert st.statuses.read("10")["state"] == CheckpointState.RESTORED


def test_job_end_of_a_gone_job_ends_its_restored_status(tmp_path: Path) -> None:
    from spswap.daemon.job_ops import op_job_end
    from spswap.daemon.state import Context

    st = _state(tmp_path, {})
    st.statuses.write("7", state=CheckpointState.RESTORED, pid=1)
    answer = op_job_end(Context(peer_uid=0, peer_pid=1, state=st),
                        {"job_id": "7", "requeued": False})  # fmt: skip
    assert answer["fate"] == "gone"
    assert st.statuses.read("7")["state"] == CheckpointState.DELETED


def test_the_epilog_of_a_job_without_images_says_so_and_names_its_owner(tmp_path: Path) -> None:
    """The epilog does not ask Slurm about a job with no image to keep or drop (it is on
    the next job's path): the event says "no-images", not "unknown", with the job's uid."""
    from spswap.daemon import events
    from spswap.daemon.job_ops import op_job_end
    from spswap.daemon.jobs import JobRecord
    from spswap.daemon.state import Context

    st = _state(tmp_path, {"7": "COMPLETED"})
    st.jobs.put(JobRecord(job_id="7", uid=1234, user="ann"))
    ctx = Context(peer_uid=0, peer_pid=1, state=st)
    assert op_job_end(ctx, {"job_id": "7"})["fate"] == "no-images"
    assert op_job_end(ctx, {"job_id": "8"})["fate"] == "no-images"  # no prolog registered it
    logged = events.tail(st.cfg.paths.events, 9)
    ends = [(e["job_id"], e["uid"], e["detail"]["fate"]) for e in logged if e["kind"] == "job.end"]
    assert ends == [("7", 1234, "no-images"), ("8", None, "no-images")]


@pytest.mark.parametrize(
    ("slurm_restarts", "fate", "images_left"), [(1, "back", 1), (0, "unknown", 1)]
)
def test_the_epilog_of_a_requeued_job_keeps_its_image_and_says_it_comes_back(
    tmp_path: Path, slurm_restarts: int, fate: str, images_left: int
) -> None:
    """A requeue's epilog runs while Slurm says COMPLETING; the restart count Slurm raised
    past the run's says the job comes back (the events said "unknown", "ended")."""
    from spswap.daemon.job_ops import op_job_end
    from spswap.daemon.jobs import JobRecord, JobState
    from spswap.daemon.state import Context

    st = _state(tmp_path, {})
    _slurm_says(st, "COMPLETING", restart_count=slurm_restarts)
    st.jobs.put(JobRecord(job_id="7", uid=1234, user="ann", restart_count=0))
    (st.cfg.paths.images / "job7-m-abc-1").mkdir(parents=True)
    answer = op_job_end(Context(peer_uid=0, peer_pid=1, state=st), {"job_id": "7"})
    assert answer["fate"] == fate
    assert answer["state"] == (JobState.REQUEUED if fate == "back" else JobState.ENDED)
    assert len(list(st.cfg.paths.images.iterdir())) == images_left


@pytest.mark.parametrize(("slurm_restarts", "after"), [
    (0, CheckpointState.DELETED),  # scancel of run 0's restored instance: COMPLETING, count kept
    (1, CheckpointState.RESTORED),  # requeued: its next run comes
])  # fmt: skip
def test_the_epilog_of_a_restored_job_that_ends_for_good_ends_its_restored_status(
    tmp_path: Path, slurm_restarts: int, after: CheckpointState
) -> None:
    """`spswap status` said "restored" for a cancelled job until a later prolog looked."""
    from spswap.daemon.job_ops import op_job_end
    from spswap.daemon.jobs import JobRecord
    from spswap.daemon.state import Context

    st = _state(tmp_path, {})
    _slurm_says(st, "COMPLETING", restart_count=slurm_restarts)
    st.jobs.put(JobRecord(job_id="7", uid=1234, user="ann", restart_count=0))
    st.statuses.write("7", state=CheckpointState.RESTORED, pid=1)
    answer = op_job_end(Context(peer_uid=0, peer_pid=1, state=st), {"job_id": "7"})
    assert answer["problems"] == []
    status = st.statuses.read("7")
    assert status["state"] == after
    if after == CheckpointState.DELETED:
        assert status["reason"] == (
            "the job is over: it ended (completed, cancelled, failed or out of time), not "
            "requeued; nothing to restore"
        )


def test_the_epilog_asks_slurm_once_for_an_image_and_a_restored_status(tmp_path: Path) -> None:
    """A restored job dumped again and then cancelled: the image's fate and the restored
    status both need Slurm's word, asked once on the next job's path."""
    from spswap.daemon.job_ops import op_job_end
    from spswap.daemon.jobs import JobRecord
    from spswap.daemon.state import Context

    st = _state(tmp_path, {})
    asked = _slurm_says(st, "COMPLETING", restart_count=1)
    st.jobs.put(JobRecord(job_id="7", uid=1234, user="ann", restart_count=1))
    st.statuses.write("7", state=CheckpointState.RESTORED, pid=1)
    (st.cfg.paths.images / "job7-m-abc-1").mkdir(parents=True)
    answer = op_job_end(Context(peer_uid=0, peer_pid=1, state=st), {"job_id": "7"})
    assert (answer["fate"], answer["problems"], asked) == ("unknown", [], ["7"])
    assert st.statuses.read("7")["state"] == CheckpointState.DELETED


@pytest.mark.parametrize(("requeued_by_spswapd", "asked"), [(True, []), (False, ["7"])])
def test_the_epilog_of_a_run_whose_dump_is_under_way_says_it_comes_back(
    tmp_path: Path, requeued_by_spswapd: bool, asked: list[str]
) -> None:
    """A parked tree lets its run end while its image is still written: the epilog's event
    said fate "no-images", state "ended" for a job spswapd had just requeued (seen on the
    H200). Requeued by spswapd: back, Slurm not asked; else Slurm decides as for an image."""
    from spswap.daemon.job_ops import op_job_end
    from spswap.daemon.jobs import JobRecord, JobState
    from spswap.daemon.state import Context

    st = _state(tmp_path, {})
    seen = _slurm_says(st, "COMPLETING", restart_count=1)
    st.jobs.put(JobRecord(job_id="7", uid=1234, user="ann", restart_count=0))
    st.statuses.write("7", state=CheckpointState.DUMPING, pid=41, pid_start=7)
    st.statuses.mark_left_job("7", requeued=requeued_by_spswapd)
    answer = op_job_end(Context(peer_uid=0, peer_pid=1, state=st), {"job_id": "7"})
    assert (answer["fate"], answer["state"], seen) == ("back", JobState.REQUEUED, asked)
    assert st.statuses.read("7")["state"] == CheckpointState.DUMPING  # the dump goes on


def _dead_pid() -> int:
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_job_that_will_not_come_back_leaves_no_dead_instance_record(tmp_path: Path) -> None:
    """`spswap status` listed the saved instances of cancelled jobs ("checkpoint; job's
    checkpoint deleted") for ever after their images went (newcomer walk): the sweep and
    the epilog that find the job gone drop its records whose process is gone."""
    from spswap.daemon.job_ops import op_job_end
    from spswap.daemon.state import Context
    from spswap.instance.registry import InstanceRecord, InstanceRegistry

    st = _state(tmp_path, {"7": "CANCELLED", "8": "RUNNING"})
    registry = InstanceRegistry(st.cfg.paths.instances)
    dead = _dead_pid()
    for rec_id, job, pid in (("a", "7", dead), ("b", "7", os.getpid()), ("c", "8", dead),
                             ("d", "11", dead)):  # fmt: skip
        registry.put(InstanceRecord(id=rec_id, model="m", state="checkpoint", pid=pid,
                                    uid=0, job_id=job))  # fmt: skip
    for job in ("7", "8"):
        st.statuses.write(job, state=CheckpointState.RESTORED, pid=1)
    assert collect_images(st, "10") == ["7"]
    # 7's dead record went, its live one stays; 8 still runs; 11 was not looked at
    assert sorted(r.id for r, _ in registry.list()) == ["b", "c", "d"]
    answer = op_job_end(Context(peer_uid=0, peer_pid=1, state=st),
                        {"job_id": "11", "requeued": False})  # fmt: skip
    assert answer["fate"] == "gone"
    assert sorted(r.id for r, _ in registry.list()) == ["b", "c"]


def test_an_ended_status_goes_once_slurm_forgets_its_job(tmp_path: Path) -> None:
    """`spswap status` listed a "deleted" row for every job ever checkpointed on the node
    (newcomer walk): a deleted, failed or rejected status goes once Slurm no longer knows
    its job (past MinJobAge), with the job's dead instance records; one Slurm still knows
    stays (it tells the owner why the job starts cold), and so do the others."""
    from spswap.instance.registry import InstanceRecord, InstanceRegistry

    st = _state(tmp_path, {"6": "PENDING", "9": "COMPLETED"})
    states = {"5": CheckpointState.DELETED, "6": CheckpointState.FAILED,
              "7": CheckpointState.REJECTED, "8": CheckpointState.SAVED,
              "9": CheckpointState.DELETED, "10": CheckpointState.DELETED}  # fmt: skip
    for job, state in states.items():
        st.statuses.write(job, state=state, reason="earlier")
    registry = InstanceRegistry(st.cfg.paths.instances)
    registry.put(InstanceRecord(id="r5", model="m", state="checkpoint", pid=_dead_pid(),
                                uid=0, job_id="5"))  # fmt: skip
    assert collect_images(st, "10") == []  # (no image, no restored status: nothing dropped)
    left = {p.stem: st.statuses.read(p.stem)["state"] for p in st.statuses.dir.glob("*.json")}
    # 5 and 7 forgotten; 6 pending and 9 still known to Slurm; 8 saved (not an ended
    # state, and without an image it is no job of the image loop); 10 the prolog's own
    assert left == {"6": CheckpointState.FAILED, "8": CheckpointState.SAVED,
                    "9": CheckpointState.DELETED, "10": CheckpointState.DELETED}  # fmt: skip
    assert registry.list() == []


def test_an_ended_jobs_dead_instance_record_goes_before_slurm_forgets_it(
    tmp_path: Path,
) -> None:
    """The admin walk: root removed a held job's image (its status deleted), then the job
    was cancelled while it waited: no epilog ran, no image was left to collect, and its
    instance row ("checkpoint; job's checkpoint deleted") stayed until Slurm forgot the
    job. The sweep drops a dead record of a job Slurm calls ended; the status stays (it
    says why), and a pending job's record stays."""
    from spswap.instance.registry import InstanceRecord, InstanceRegistry

    st = _state(tmp_path, {"520": "CANCELLED", "521": "PENDING"})
    registry = InstanceRegistry(st.cfg.paths.instances)
    for job in ("520", "521"):
        st.statuses.write(job, state=CheckpointState.DELETED, reason="root removed it")
        registry.put(InstanceRecord(id=f"r{job}", model="m", state="checkpoint",
                                    pid=_dead_pid(), uid=0, job_id=job))  # fmt: skip
    collect_images(st, "")
    assert [r.id for r, _ in registry.list()] == ["r521"]
    assert st.statuses.jobs_in(CheckpointState.DELETED) == ["520", "521"]


def test_ended_statuses_stay_while_slurm_does_not_answer(tmp_path: Path) -> None:
    st = _state(tmp_path, {})
    asked: list[str] = []

    def unreachable(job_id: str) -> tuple[JobInfo | None, bool]:
        asked.append(job_id)
        return None, False

    st.ask_slurm = unreachable  # type: ignore[method-assign]
    for job in ("5", "6"):
        st.statuses.write(job, state=CheckpointState.DELETED)
    collect_images(st, "")
    assert st.statuses.jobs_in(CheckpointState.DELETED) == ["5", "6"]
    assert asked == ["5"]  # one ask a sweep while the controller is away


def test_how_a_job_ended_is_said_in_the_users_words() -> None:
    from spswap.daemon.job_ops import over_text

    ended = "it ended (completed, cancelled, failed or out of time), not requeued"
    assert over_text("COMPLETING") == ended and over_text("") == ended
    assert over_text("CANCELLED by 0") == "Slurm said CANCELLED by 0 at its end, not requeued"
    assert over_text("TIMEOUT") == "Slurm said TIMEOUT at its end, not requeued"
