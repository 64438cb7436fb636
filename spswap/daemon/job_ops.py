"""A job's runs on this node: its prolog's ``job.register``, its run's ``job.starting``,
and its epilog's ``job.end`` (the job's slots and pool uses given back; its checkpoint
images kept only when the job comes back), and the images of other jobs that will not come
back, collected at each prolog."""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

from spswap.checkpoint.service import (
    image_job_ids,
    images_of_job,
    real_job_id,
    real_job_ids,
    temp_dirs,
)
from spswap.daemon import prewake
from spswap.daemon.ckpt_status import running_job
from spswap.daemon.image_uses import drop_job_images
from spswap.daemon.instance_ops import registry_of
from spswap.daemon.jobs import JobRecord, JobState, check_job_id
from spswap.daemon.protocol import Answer
from spswap.daemon.slot_ops import give_way_to_job
from spswap.daemon.state import Context, DaemonState, require_root
from spswap.daemon.statuses import ENDED_STATES, CheckpointState
from spswap.errors import RequestRefused, SpswapError
from spswap.pool.store import Pool
from spswap.slurm.parse import JobInfo, job_fate, stopped_for_good


def op_job_register(ctx: Context, args: dict[str, Any]) -> Answer:
    require_root(ctx.peer_uid, "job.register")
    st = ctx.state
    with st.lock:
        if args.get("node"):
            st.node_names.add(str(args["node"]))
        st.jobs.prune()
        rec = JobRecord(
            job_id=args["job_id"], uid=args["uid"], user=args.get("user", ""),
            gpus=list(args.get("gpus", [])), restart_count=args.get("restart_count", 0),
            registered_at=time.time(),
        )  # fmt: skip
        st.jobs.put(rec)
    st.event("job.start", job_id=rec.job_id, uid=rec.uid, user=rec.user, gpus=rec.gpus,
             restart_count=rec.restart_count)  # fmt: skip
    try:
        give_way_to_job(st, rec)
    except (SpswapError, OSError) as e:  # the job is registered: its prolog goes on
        st.event("slots.revoke_failed", job_id=rec.job_id, error=str(e))
    # Off the prolog's path: the epilog cannot tell a requeued job from a finished one
    # (both COMPLETING), so each prolog looks again at the jobs that left images behind.
    threading.Thread(target=collect_images, args=(st, rec.job_id), daemon=True).start()
    # back on its GPUs: its kept tree's GPU state (or its image, restored into a kept
    # tree: prerestore) before its run asks
    if st.kept.has(rec.job_id) or st.held_cgroups.has(rec.job_id):
        prewake.start(st, rec.job_id)
    return rec.to_json()


def op_job_starting(ctx: Context, args: dict[str, Any]) -> Answer:
    """A run of the caller's job starts here (``spswap serve`` sends it before its imports,
    a few hundredths of a second into the run): its kept tree's GPU state is woken early
    now where no prolog did it (slurmd ran none for this run: :mod:`spswap.daemon.missed_prolog`
    registers the run here). The prolog's wake, done or under way, is never done twice."""
    st = ctx.state
    rec = running_job(ctx, args["job_id"])  # the caller's own job, running here
    kept = st.kept.get(rec.job_id)
    # (a wake the prolog did is not done again; an image restored early is a kept tree)
    waking = (kept is not None and kept.early_timings is None) or (
        kept is None and st.held_cgroups.has(rec.job_id))  # fmt: skip
    if waking:
        prewake.start(st, rec.job_id)
    st.event("job.starting", job_id=rec.job_id, uid=rec.uid, pid=ctx.peer_pid,
             restart_count=rec.restart_count, waking=waking)  # fmt: skip
    return {"job_id": rec.job_id, "restart_count": rec.restart_count, "waking": waking}


def op_images_remove(ctx: Context, args: dict[str, Any]) -> Answer:
    """``spswap images rm JOB`` (root): delete the job's checkpoint images on this node and
    end its kept tree, with their pool uses and images budget, as when the job will not come
    back; its next run here starts from the pool. Refused while the job is dumped or
    restored, or runs here (its run is about to take its image)."""
    require_root(ctx.peer_uid, "images.remove", "root (`spswap images rm`)")
    st = ctx.state
    job_id = check_job_id(args["job_id"])
    # a het job's images show its '+' as '_' (`spswap images ls`): its locks and records
    # are under the real id
    job_id = real_job_id(real_job_ids(st.statuses.dir), job_id)
    lock = st.job_locks.of(job_id)
    if not lock.acquire(blocking=False):
        raise RequestRefused(f"job {job_id}'s checkpoint is being saved or restored now: run "
                             f"`spswap images rm {job_id}` again when that has ended "
                             "(`spswap status`)")  # fmt: skip
    try:
        rec = st.jobs.get(job_id)
        if rec is not None and rec.state is JobState.RUNNING:
            raise RequestRefused(f"job {job_id} runs on this node now (its run takes its "
                                 "image, if it has one): once it is queued again, hold it "
                                 f"there (`scontrol hold {job_id}`) and run `spswap images rm "
                                 f"{job_id}`")  # fmt: skip
        images = st.cfg.paths.images
        kept = st.kept.has(job_id)
        found = bool(images_of_job(images, job_id) or temp_dirs(images, job_id) or kept
                     or st.held_cgroups.has(job_id))  # fmt: skip
        # (the status says what happened; each reader says what it means for the run)
        gone = drop_job_images(st, job_id, "root removed it with spswap images rm") \
            if found else []  # fmt: skip
    finally:
        lock.release()
    if found:
        st.event("images.removed", job_id=job_id, images_deleted=gone, kept_ended=kept)
    return {"job_id": job_id, "found": found, "images_deleted": gone, "kept_ended": kept}


def collect_images(st: DaemonState, current_job: str) -> list[str]:
    """Delete the images (and kept trees) of jobs that will not be restored here, never
    the current job's: Slurm says they are gone, or they run on another node now (this
    node's image would roll back what the job does there, and a kept tree holds memory).
    A restored instance's job is looked at too (its image went at the restore): when it
    will not come back its status says so instead of "restored" for ever. The dead
    instance records of such jobs go too, and the ended statuses of jobs Slurm no longer
    knows. Returns the job ids whose images (or restored status) went."""
    gone = []
    with_images = set(image_job_ids(st.cfg.paths.images, st.statuses.dir))
    jobs = with_images | set(st.statuses.jobs_in(CheckpointState.RESTORED))
    for job_id in sorted(jobs):
        if job_id == current_job:
            continue
        reason = _not_coming_back(st, job_id)
        if reason:
            drop_job_images(st, job_id, reason)
            st.event("images.collected", job_id=job_id, reason=reason)
            forget_instances(st, job_id)
            gone.append(job_id)
    _forget_ended_statuses(st, skip={current_job, *with_images, *gone})
    return gone


def _forget_ended_statuses(st: DaemonState, skip: set[str]) -> None:
    """Remove the statuses (deleted, failed, rejected) of jobs Slurm no longer knows (past
    its MinJobAge): `spswap status` listed every job ever checkpointed here, for ever.
    A job Slurm still knows keeps its status: it says its owner why the job starts cold;
    once that job has ended its dead instance records go (the walk: a job whose image
    root removed, then cancelled while it waited, never ran an epilog, and its instance
    row stayed until Slurm forgot the job)."""
    for job_id in st.statuses.jobs_in(*ENDED_STATES):
        if job_id in skip:
            continue
        info, answered = st.ask_slurm(job_id)
        if not answered:
            return  # (no controller: the next sweep asks again, one event, not one a job)
        if info is None:
            st.statuses.remove(job_id)
            forget_instances(st, job_id)
            st.event("checkpoint.forgotten", job_id=job_id,
                     reason="Slurm no longer knows the job")  # fmt: skip
        elif job_fate(info.state, None) == "gone":
            forget_instances(st, job_id)


def forget_instances(st: DaemonState, job_id: str) -> list[str]:
    """Drop the instance records of a job that will not come back here whose process is
    gone (what `spswap status` showed of them: a saved instance, now deleted)."""
    dropped = registry_of(st).drop_dead_of_job(job_id)
    if dropped:
        st.event("instances.forgotten", job_id=job_id, instances=dropped)
    return dropped


def _not_coming_back(st: DaemonState, job_id: str) -> str | None:
    """Why the job's images here will not be restored, or None (back, or not known)."""
    info, answered = st.ask_slurm(job_id)
    if info is None:
        # the controller answered but no longer knows it: finished, past MinJobAge
        return "Slurm no longer knows the job" if answered else None
    if job_fate(info.state, None) == "gone":
        return f"the job ended ({info.state})"
    if info.runs_elsewhere(st.node_names):
        return f"the job runs on {info.nodes} now, not on {', '.join(sorted(st.node_names))}"
    return None


def _release_job_reservations(st: DaemonState, job_id: str) -> list[str]:
    table = st.slot_table()
    released = []
    for r in table.reservations():
        if r.holder.job_id == job_id:
            try:
                table.release(r.id)
                released.append(r.id)
            except SpswapError:
                pass  # reclaimed meanwhile
    return released


def _drop_job_pool_uses(st: DaemonState, job_id: str) -> list[str]:
    if not st.cfg.paths.pool.is_dir():
        return []

    pool = Pool.from_config(st.cfg, job_alive=st.job_probe())
    dropped = []
    for entry in pool.entries():
        for holder in entry.users:
            if holder.job_id == job_id:
                pool.release_use(entry.manifest.digest, holder)
                dropped.append(entry.manifest.digest)
    return dropped


def op_job_end(ctx: Context, args: dict[str, Any]) -> Answer:
    """The epilog: give back the job's slots and pool uses; keep the pool. The job's
    checkpoint images stay only if it comes back (requeued): Slurm says so, or, where
    Slurm does not know the job, the ``requeued`` argument; when neither can tell they
    stay (an unused image costs tmpfs, a deleted one a cold start)."""
    require_root(ctx.peer_uid, "job.end")
    st = ctx.state
    job_id = args["job_id"]
    requeued = args.get("requeued")
    problems = []
    released: list[str] = []
    dropped: list[str] = []
    images_deleted: list[str] = []
    try:
        released = _release_job_reservations(st, job_id)
    except Exception as e:  # the rest of the epilog still runs
        problems.append(f"slots: {e}")
    try:
        dropped = _drop_job_pool_uses(st, job_id)
    except Exception as e:
        problems.append(f"pool: {e}")
    try:  # woken early for this run, never taken: it holds GPU memory past the job (one
        # kept on its GPU after this run's dump waits there for the next run)
        prewake.end_if_untaken(st, job_id, keep_resident=True)
    except Exception as e:
        problems.append(f"kept tree: {e}")
    fate = "unknown"
    ending = _EndingRun(st, job_id)
    try:
        fate = _job_fate(ending, requeued)
        if fate == "gone":
            images_deleted = drop_job_images(st, job_id)
            forget_instances(st, job_id)
    except Exception as e:
        problems.append(f"images: {e}")
    try:
        if fate != "back":
            _end_restored_status(ending)
    except Exception as e:
        problems.append(f"checkpoint status: {e}")
    with st.lock:
        rec = st.jobs.get(job_id) or JobRecord(job_id=job_id, uid=-1)
        rec.state = JobState.REQUEUED if requeued or fate == "back" else JobState.ENDED
        rec.ended_at = time.time()
        st.jobs.put(rec)
    result = {"job_id": job_id, "state": rec.state, "released_reservations": released,
              "dropped_pool_uses": dropped, "fate": fate, "images_deleted": images_deleted,
              "problems": problems}  # fmt: skip
    st.event(
        "job.end", job_id=job_id, uid=rec.uid if rec.uid >= 0 else None, state=rec.state,
        fate=fate,
        released_reservations=released, dropped_pool_uses=dropped,
        images_deleted=images_deleted, problems=problems,
    )  # fmt: skip
    return result


class _EndingRun:
    """The job whose run the epilog ends, with what Slurm says of it: asked at most once,
    and only by a step that needs it (the epilog is on the next job's path)."""

    def __init__(self, st: DaemonState, job_id: str) -> None:
        self.st, self.job_id = st, job_id

    @functools.cached_property
    def slurm(self) -> JobInfo | None:
        return self.st.ask_slurm(self.job_id)[0]

    @functools.cached_property
    def restart_count(self) -> int | None:
        """The ending run's (a requeue has raised Slurm's count past it)."""
        rec = self.st.jobs.get(self.job_id)
        return rec.restart_count if rec is not None else None


def over_text(slurm_state: str) -> str:
    """How a job that ended for good ended, from Slurm's state at its end: COMPLETING is
    what Slurm 22.05 shows there for every end (completed, cancelled, failed, out of
    time; a walk read "Slurm said COMPLETING" of a job that had just finished). Pure."""
    words = slurm_state.split()
    if not words or words[0].upper() == "COMPLETING":
        return "it ended (completed, cancelled, failed or out of time), not requeued"
    return f"Slurm said {slurm_state} at its end, not requeued"


def _end_restored_status(ending: _EndingRun) -> None:
    """A job whose instance was restored and that ends for good (scancel, its end): its
    status says so now, not "restored" until a later prolog looks (Slurm is asked only
    for such a job)."""
    st, job_id = ending.st, ending.job_id
    if st.statuses.read(job_id).get("state") != CheckpointState.RESTORED:
        return
    info = ending.slurm
    if info is not None and stopped_for_good(info.state, info.restart_count,
                                             ending.restart_count):  # fmt: skip
        reason = f"the job is over: {over_text(info.state)}; nothing to restore"
        st.statuses.mark_gone(job_id, reason, images_deleted=False)


def _job_fate(ending: _EndingRun, requeued: bool | None) -> str:
    """ "back", "gone" or "unknown"; asks Slurm only when the job has images to decide on,
    or one being dumped (the epilog is on the next job's path), else "no-images" where the
    caller did not say. A run whose tree left its job ends while its image is still being
    written: where spswapd requeued the job itself, it is back without asking Slurm."""
    images = ending.st.cfg.paths.images
    status = ending.st.statuses.read(ending.job_id)
    dumping = status.get("state") == CheckpointState.DUMPING
    if dumping and status.get("requeued") and requeued is None:
        return "back"
    if (not dumping and not images_of_job(images, ending.job_id)
            and not temp_dirs(images, ending.job_id)):  # fmt: skip
        return "no-images" if requeued is None else job_fate(None, requeued)
    info = ending.slurm
    if info is None:
        return job_fate(None, requeued)
    return job_fate(info.state, requeued, info.restart_count, ending.restart_count)
