"""`spswap images rm JOB` (root): spswapd deletes a job's images, ends its kept tree and
says so in its events and the job's checkpoint status; refused while the job's image is
being saved or restored, or the job runs here, and for a name that is not a job id."""

from __future__ import annotations

from pathlib import Path

import pytest

from spswap.checkpoint.images import META_FILE
from spswap.config import Config
from spswap.daemon import events, lifecycle
from spswap.daemon.job_ops import op_images_remove
from spswap.daemon.jobs import JobRecord, JobState
from spswap.daemon.state import Context, DaemonState
from spswap.daemon.statuses import CheckpointState
from spswap.errors import BadRequest, PermissionDenied, RequestRefused
from spswap.fsutil import atomic_write_json
from tests.uids import as_user


def _state(tmp_path: Path) -> DaemonState:
    cfg = Config.from_env({"SPSWAP_GPUS": "0"}, root=tmp_path / "root")
    lifecycle.prepare_dirs(cfg)
    return DaemonState(cfg)


def _image(st: DaemonState, key: str) -> Path:
    image = st.cfg.paths.images / key
    image.mkdir(parents=True)
    atomic_write_json(image / META_FILE, {"identity": {"model_digest": "ab" * 32}})
    (image / "pages-1.img").write_bytes(b"x" * 4096)
    return image


def test_root_deletes_a_jobs_images_and_the_job_is_told_so(tmp_path: Path) -> None:
    st = _state(tmp_path)
    seven, seventy = _image(st, "job7-aaaa-bbbb"), _image(st, "job70-aaaa-bbbb")
    st.statuses.write("7", state=CheckpointState.SAVED)
    root = Context(peer_uid=0, peer_pid=1, state=st)
    got = op_images_remove(root, {"job_id": "7"})
    assert (got["job_id"], got["found"], len(got["images_deleted"])) == ("7", True, 1)
    assert not seven.exists() and seventy.is_dir()  # job 70's stays
    status = st.statuses.read("7")
    assert status["state"] == CheckpointState.DELETED
    assert status["reason"] == "root removed it with spswap images rm"
    (event,) = [e for e in events.tail(st.cfg.paths.events, 20) if e["kind"] == "images.removed"]
    assert event["job_id"] == "7"
    # nothing left: said so, and no event
    assert op_images_remove(root, {"job_id": "7"}) == {"job_id": "7", "found": False,
                                                       "images_deleted": [],
                                                       "kept_ended": False}  # fmt: skip
    assert (
        len([e for e in events.tail(st.cfg.paths.events, 20) if e["kind"] == "images.removed"]) == 1
    )


def test_images_rm_is_refused_where_it_would_break_a_run(tmp_path: Path) -> None:
    st = _state(tmp_path)
    image = _image(st, "job8-aaaa-bbbb")
    root = Context(peer_uid=0, peer_pid=1, state=st)
    with st.job_locks.of("8"):  # a dump or restore of job 8 under way
        with pytest.raises(
            RequestRefused,
            match=r"being saved or restored now: run `spswap "
            r"images rm 8` again when that has ended \(`spswap status`\)",
        ):
            op_images_remove(root, {"job_id": "8"})
    st.jobs.put(JobRecord(job_id="8", uid=1000, state=JobState.RUNNING))
    with pytest.raises(RequestRefused, match=r"job 8 runs on this node now"):
        op_images_remove(root, {"job_id": "8"})
    with pytest.raises(BadRequest, match=r"is not a Slurm job id"):
        op_images_remove(root, {"job_id": "../8"})
    with pytest.raises(PermissionDenied, match=r"images.remove is for root"):
        op_images_remove(Context(peer_uid=1000, peer_pid=1, state=st), {"job_id": "8"})
    assert image.is_dir()
    assert not st.job_locks.of("8").locked()  # let go after each refusal


def _rm(root: str) -> str:
    from spswap.cli.images import rm

    try:
        rm(job="7", json=False, root=Path(root))
    except PermissionDenied as e:
        return str(e)
    return "not refused"


def test_a_user_is_told_to_ask_root(tmp_path: Path, user_uid: int) -> None:
    """The command refuses a user before any daemon is asked (none runs here)."""
    assert as_user(user_uid, _rm, str(tmp_path)) == (
        "only root deletes checkpoint images: ask the node's admin to run `spswap images rm "
        "7` (yours go by themselves when your job ends for good)")  # fmt: skip


def test_a_het_jobs_image_is_found_by_the_name_images_ls_shows(tmp_path: Path) -> None:
    """A het job's '+' is '_' in its images' names (and `spswap images ls`): `images rm
    1234_0` takes the real job's lock and records (its status says deleted), and a dump
    of the real job under way refuses it."""
    st = _state(tmp_path)
    image = _image(st, "job1234_0-aaaa-bbbb")
    st.statuses.write("1234+0", state=CheckpointState.SAVED)
    root = Context(peer_uid=0, peer_pid=1, state=st)
    with st.job_locks.of("1234+0"), pytest.raises(RequestRefused, match=r"job 1234\+0's"):
        op_images_remove(root, {"job_id": "1234_0"})
    got = op_images_remove(root, {"job_id": "1234_0"})
    assert (got["job_id"], got["found"]) == ("1234+0", True) and not image.exists()
    assert st.statuses.read("1234+0")["state"] == CheckpointState.DELETED


def test_what_images_rm_says_it_did() -> None:
    from spswap.cli.images import removed_text

    tail = ": its next run here starts from the pool"
    assert removed_text("7", {"found": False, "images_deleted": []}) == (
        "job 7 has no checkpoint image on this node (`spswap images ls` lists them)"
    )
    assert removed_text("7", {"found": True, "images_deleted": ["job7-a"],
                              "kept_ended": False}) == (
        "deleted job 7's checkpoint image (job7-a)" + tail)  # fmt: skip
    assert removed_text("7", {"found": True, "images_deleted": ["job7-a"], "kept_ended": True}) == (
        "deleted job 7's checkpoint image (job7-a) and ended its instance kept alive" + tail
    )
    assert removed_text("7", {"found": True, "images_deleted": [], "kept_ended": True}) == (
        "ended job 7's instance kept alive" + tail
    )
    assert removed_text("7", {"found": True, "images_deleted": [], "kept_ended": False}) == (
        "released what spswapd held for job 7" + tail
    )


def test_the_runs_reason_names_the_cause_once() -> None:
    """The requeued run's log line (after `spswap serve: starts anew: `) from the status
    `spswap images rm` leaves: what happened and why, no 'next run' (this is that run)."""
    from spswap.daemon.ckpt_status import no_image_reason

    status = {"state": CheckpointState.DELETED, "reason": "root removed it with spswap images rm"}
    assert no_image_reason("958", status) == (
        "job 958 has no saved image: its image was deleted (root removed it with spswap "
        "images rm): cold start"
    )
    assert no_image_reason("958", {"state": CheckpointState.FAILED}) == (
        "job 958 has no saved image: its dump failed: cold start"
    )
    assert no_image_reason("958", {"state": "none"}) == (
        "job 958 has no checkpoint image (never dumped on this node): cold start"
    )
