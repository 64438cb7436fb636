"""The daemon's checkpoint, restore and checkpoint.status ops.

Flow, for one job's instance P and, after the requeue, the new run's proxy Q:

- P (asleep, slot released) asks ``checkpoint``. The daemon answers at once and dumps P in
  a thread once P has closed the connection (a connected socket cannot be dumped). On
  success P is gone and its image is on tmpfs, or, when P was parked outside its job and
  fits the keep budget, P is kept: alive beside its image, frozen in its parked cgroup
  (:class:`_Kept`). On failure P runs on and gets SIGUSR2.
- Q (new run, restart count > 0, slot reserved) asks ``restore``. The daemon wakes the
  kept P (identity check, thaw, CUDA restore and unlock), or checks the image's identity
  and integrity and restores P (CUDA restore and unlock included); it moves P into Q's
  cgroups, records the new run for P and sends P SIGUSR2; P asks ``checkpoint.status``
  and carries on.
- A rejected image (other identity, changed bytes) is deleted and Q cold-starts; the
  reason goes to the event log, the answer and ``spswap status``.

Image lifecycle: while an image exists its pool entry must stay (the restored process
maps the entry's file by path), so the daemon holds one pool use per image on disk
(holder: the daemon process itself, no job; see :func:`sync_image_uses`). The uses are
re-counted after every dump, restore and job end and at start-up, so a daemon killed
with ``-9`` (its uses die with it) takes them back when it starts again.
:func:`recover` (start-up) also fails a dump the dead daemon left "dumping", resumes
the instance when it still runs, and deletes unfinished dumps.

The identity parts the caller cannot be trusted with (uid, driver, GPU model, CRIU) are
taken by the daemon itself; the caller names its engine, versions, model and config.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spswap.checkpoint.images import Identity, node_identity
from spswap.errors import CheckpointFailed, DaemonError
from spswap.fsutil import atomic_write_json, read_json
from spswap.liveness import pid_alive, pid_start_time

if TYPE_CHECKING:  # handlers imports this module to register the ops
    from spswap.daemon.handlers import Context, DaemonState


def _job_for(ctx: Context, job_id: str) -> Any:
    from spswap.daemon.handlers import _job_for as job_for

    return job_for(ctx, job_id)

IDENTITY_ARGS = ("engine", "engine_version", "torch", "python", "model_digest", "config_hash")
RESUME_SIGNAL = signal.SIGUSR2
RESTORE_WAITS_DUMP_S = 300.0  # a restore that finds its own job still dumping waits this long


def _identity(args: dict[str, Any], uid: int) -> Identity:
    missing = [a for a in IDENTITY_ARGS if not args.get(a)]
    if missing:
        raise DaemonError(f"checkpoint identity incomplete: give {', '.join(missing)}")
    return Identity(uid=uid, **{a: str(args[a]) for a in IDENTITY_ARGS}, **node_identity())


def _status_path(st: DaemonState, job_id: str) -> Path:
    return st.cfg.paths.run / "checkpoints" / f"{job_id}.json"


def _set_status(st: DaemonState, job_id: str, **status: Any) -> None:
    path = _status_path(st, job_id)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    atomic_write_json(path, {"job_id": job_id, **status})


def op_checkpoint(ctx: Context, args: dict[str, Any]) -> Any:
    """Dump the caller (its own process; root may name another pid)."""
    st = ctx.state
    job_id = args["job_id"]
    rec = _job_for(ctx, job_id)
    _require_running(rec)
    pid = int(args.get("pid") or ctx.peer_pid)
    if ctx.peer_uid != 0 and pid != ctx.peer_pid:
        raise DaemonError("a user may checkpoint only the calling process itself: leave out "
                          "pid")  # fmt: skip
    pid_start = pid_start_time(pid)
    identity = _identity(args, rec.uid)
    from spswap.checkpoint.criu import find_criu

    if find_criu() is None:
        raise CheckpointFailed("no CRIU on this node: run scripts/build_criu.sh (see doctor)")
    # held until the dump thread ends (it releases it)
    if not _job_lock(job_id).acquire(blocking=False):
        raise CheckpointFailed(f"job {job_id} is being checkpointed or restored already")
    # the job's earlier kept instance would otherwise outlive the image the dump replaces
    _end_kept(st, job_id, "the job dumps again")
    _set_status(st, job_id, state="dumping", pid=pid, pid_start=pid_start)
    with _USES_LOCK:  # the entry is held while the dump runs (see sync_image_uses)
        _DUMPING[job_id] = identity.model_digest
    st.event("checkpoint.start", job_id=job_id, uid=rec.uid, pid=pid)
    requeue = bool(args.get("requeue"))
    threading.Thread(target=_dump_locked, args=(st, job_id, pid, pid_start, identity, requeue),
                     daemon=True).start()  # fmt: skip
    return {"accepted": True, "pid": pid}


_JOB_LOCKS: dict[str, threading.Lock] = {}
_JOB_LOCKS_GUARD = threading.Lock()


def _job_lock(job_id: str) -> threading.Lock:
    """One checkpoint or restore of a job at a time (a second would delete the first's
    image under it)."""
    with _JOB_LOCKS_GUARD:
        return _JOB_LOCKS.setdefault(job_id, threading.Lock())


def _require_running(rec: Any) -> None:
    if rec.state != "running":
        raise CheckpointFailed(
            f"job {rec.job_id} is {rec.state} on this node: checkpoints and restores are for "
            "the job's running instance (its prolog registers each run)"
        )


def _dump_locked(st: DaemonState, job_id: str, pid: int, pid_start: int | None,
                 identity: Identity, requeue: bool) -> None:  # fmt: skip
    leave = _LeaveJob(st, job_id, requeue)
    try:
        try:
            gone = _dump(st, job_id, pid, pid_start, identity, leave)
        finally:
            leave.close()
    finally:
        _job_lock(job_id).release()  # a restore may come at once: Slurm calls are slow
    if leave.kept:  # outside the job lock: ending other jobs' trees takes time
        _keep_within_budget(st)
    if requeue and gone and not leave.early:
        # only once the process is gone (saved, or lost after CRIU ended it): the image is
        # worth nothing if the job does not come back, and a cold start needs it back too
        _requeue(st, job_id)


class _LeaveJob:
    """Takes the instance's tree out of its job's cgroup right before CRIU runs (after
    every check, and after the CUDA checkpoint freed its GPU memory): neither a requeue
    nor preemption's kill after GraceTime can then cut the dump short, and a requeue the
    instance asked for is made at once, so the next job starts while the dump runs. No
    job cgroup to leave (proctrack/linuxproc), or a move that fails: the dump runs
    inside the job, and the requeue follows it, as it always did."""

    def __init__(self, st: DaemonState, job_id: str, requeue: bool) -> None:
        self.st, self.job_id, self.requeue = st, job_id, requeue
        self.parking: Any = None
        self.early = False
        self.kept = False  # the dumped tree is kept alive (see :class:`_Kept`)

    def __call__(self, tree: list[int]) -> list[tuple[Path, str]] | None:  # before_criu
        """Park. When the dumped tree is to be kept alive (:class:`_Kept`: a parked tree
        that fits the keep budget), the writes that freeze its parked cgroup, which CRIU
        makes before it lets the tree go; None otherwise."""
        from spswap.checkpoint import link_remap
        from spswap.checkpoint.proctree import anon_rss_bytes

        try:
            self.parking = _park_out_of_job(self.st, self.job_id, tree)
            if self.parking is not None and self.requeue:
                _sync_quietly(self.st)  # the entry held for the dump before the epilog runs
                self.early = _requeue(self.st, self.job_id, early=True)
            budget = self.st.cfg.keep_budget_bytes()
            if self.parking is None or budget <= 0 or anon_rss_bytes(tree) > budget:
                return None  # (a tree larger than the whole budget would be ended at once)
            if not link_remap.in_root_dirs(link_remap.deleted_but_linked(tree)):
                return None  # CRIU's post-dump step links files only in root's directories
            writes = self.parking.freeze_writes()
            return writes or None
        except Exception as e:  # noqa: BLE001 - must not raise: the dump goes on regardless
            self._event("checkpoint.stays_in_job", reason=str(e)[:500])
            return None

    def after_failure(self, tree_kept: bool = False) -> str:
        """A failed dump: the instance back into its job, where it runs on; ended when
        the job was requeued already or its cgroup is gone, or when the failure came after
        a CRIU run that left it running without its GPU state (``tree_kept``). Returns
        what to add to the reason."""
        if self.parking is None:
            return ""
        if tree_kept:
            self.parking.kill_all()
            return "; the instance, left without its GPU state, was ended (its saved " \
                "requests are kept)"
        if self.early:
            self.parking.kill_all()
            return ("; the job had been requeued while the dump ran, so the instance was "
                    "ended: its next run starts without the image (its saved requests are "
                    "kept)")  # fmt: skip
        if self.parking.return_home():
            self.parking.kill_all()
            return "; its job's cgroup was gone, so the instance was ended"
        return ""

    def close(self) -> None:
        """After the dump: unless the tree is kept, whatever is still parked (a fork that
        left the tree, or a tree that could not be kept) is ended and the parked cgroups
        go. Never raises (the job lock is released after it)."""
        if self.parking is None or self.kept:
            return
        try:
            killed = self.parking.kill_all()
            self.parking.remove()
            if killed:
                self._event("checkpoint.parked_killed", pids=killed)
        except Exception:  # noqa: BLE001,S110 - start-up's sweep takes what is left
            pass

    def keep(self, pid: int, pid_start: int | None, key: str) -> bool:
        """After a dump that left the tree running: check it is frozen where it is parked
        (CRIU's post-dump step froze it) and record it; False (:meth:`close` then ends it,
        the image stays) when it is gone or not frozen: it must not run outside a job."""
        if not pid_alive(pid, pid_start) or not self.parking.freeze():
            self._event("checkpoint.not_kept", pid=pid,
                        reason="the dumped instance could not be frozen where it waits")
            return False
        kept = _Kept(self.job_id, pid, pid_start, self.parking, key, time.time())
        with _KEPT_LOCK:
            _KEPT[self.job_id] = kept
        self.kept = True
        self._event("checkpoint.kept", pid=pid, size_bytes=kept.size_bytes())
        return True

    def _event(self, kind: str, **fields: Any) -> None:
        try:
            self.st.event(kind, job_id=self.job_id, **fields)
        except OSError:  # a full log must not cost the dump
            pass


@dataclass
class _Kept:
    """A dumped instance left alive (CRIU's ``--leave-running``), CUDA-checkpointed and
    frozen in its parked cgroups (by CRIU's post-dump step, before CRIU let it go: it runs
    no code outside a job), beside its image: the job's next run gets it back with a
    CUDA restore alone, without CRIU's restore (most of a swap's time). It holds host
    memory only (its GPU state is in host memory), the same bytes as its image: the
    daemon keeps such trees within ``keep_bytes`` (oldest ended first) and ends one
    whenever its image goes; the image stays the way back when a tree is ended. A daemon
    that dies leaves them to the next one's start-up sweep (the images stay)."""

    job_id: str
    pid: int
    pid_start: int | None
    parking: Any
    key: str  # its image
    since: float

    def alive(self) -> bool:
        return pid_alive(self.pid, self.pid_start) and self.pid in self.parking.pids()

    def size_bytes(self) -> int:
        from spswap.checkpoint.proctree import anon_rss_bytes

        return anon_rss_bytes(self.parking.pids())

    def end(self) -> list[int]:
        """Kill the tree (frozen or not) and remove its cgroups; the pids it had."""
        killed = self.parking.kill_all()
        self.parking.remove()
        return killed


_KEPT: dict[str, _Kept] = {}  # job id -> its kept instance
_KEPT_LOCK = threading.Lock()


def _end_kept(st: DaemonState, job_id: str, reason: str, *, key: str | None = None) -> bool:
    """End the job's kept instance (only the one kept for image ``key`` when given);
    True when there was one."""
    with _KEPT_LOCK:
        kept = _KEPT.get(job_id)
        if kept is None or (key is not None and kept.key != key):
            return False
        del _KEPT[job_id]
    _finish_kept(st, kept, reason)
    return True


def _finish_kept(st: DaemonState, kept: _Kept, reason: str) -> None:
    """End a kept tree no longer in :data:`_KEPT`; its job's status and the log say so."""
    try:
        kept.end()
    finally:
        _not_kept_any_more(st, kept.job_id)
        st.event("kept.ended", job_id=kept.job_id, pid=kept.pid, reason=reason)


def _not_kept_any_more(st: DaemonState, job_id: str) -> None:
    """A saved job's status no longer says kept (``spswap status``): its image remains."""
    status = read_json(_status_path(st, job_id)) or {}
    if status.get("state") == "saved" and status.get("kept"):
        rest = {k: v for k, v in status.items() if k not in ("job_id", "kept")}
        _set_status(st, job_id, **rest, kept=False)


def over_budget(sizes_oldest_first: list[tuple[str, int]], budget_bytes: int) -> list[str]:
    """The jobs whose kept instances to end, oldest first, until the rest fit
    ``budget_bytes``. Pure."""
    total = sum(n for _, n in sizes_oldest_first)
    out = []
    for job_id, n in sizes_oldest_first:
        if total <= budget_bytes:
            break
        out.append(job_id)
        total -= n
    return out


def _keep_within_budget(st: DaemonState) -> None:
    """End the oldest kept instances until the rest fit ``keep_bytes``."""
    budget = st.cfg.keep_budget_bytes()
    with _KEPT_LOCK:
        kept = sorted(_KEPT.values(), key=lambda k: k.since)
    sizes = [(k.job_id, k.size_bytes()) for k in kept]
    total = sum(n for _, n in sizes)
    keys = {k.job_id: k.key for k in kept}
    for job_id in over_budget(sizes, budget):
        _end_kept(st, job_id, f"over the keep budget ({total} > {budget} bytes): its next "
                  "run restores from the image", key=keys[job_id])  # fmt: skip


def _park_out_of_job(st: DaemonState, job_id: str, tree: list[int]) -> Any:
    """The tree moved into a parked cgroup of spswapd's (see _LeaveJob), or None."""
    from spswap.checkpoint import cgroups, proctree

    parking = cgroups.Parking.create(f"{cgroups.root_tag(st.cfg.root)}-{job_id}-{tree[0]}",
                                     tree[0])  # fmt: skip
    if parking is None:
        return None
    try:
        new = tree
        for _ in range(3):  # again for anything forked meanwhile
            parking.adopt(new)
            new = [p for p in proctree.process_tree_pids(tree[0]) if p not in parking.homes]
            if not new:
                break
        if new:
            raise CheckpointFailed(f"the tree keeps forking ({len(new)} new processes)")
    except Exception as e:  # noqa: BLE001 - the dump still runs, inside the job
        if parking.return_home():
            parking.kill_all()  # their job is gone: they would not survive it anyway
        parking.remove()
        st.event("checkpoint.stays_in_job", job_id=job_id, reason=str(e)[:500])
        return None
    st.event("checkpoint.parked", job_id=job_id, pids=sorted(parking.homes),
             cgroups=[str(d) for d in parking.dirs.values()])  # fmt: skip
    return parking


def _dump(st: DaemonState, job_id: str, pid: int, pid_start: int | None, identity: Identity,
          leave: _LeaveJob) -> bool:  # fmt: skip
    """Dump and record the outcome; True when the instance is gone (dumped, or killed by
    CRIU before a later step failed), False when it runs on."""
    from spswap.checkpoint.service import dump_instance

    try:
        try:
            report = dump_instance(st.cfg.paths.images, job_id=job_id, pid=pid,
                                   identity=identity, gpu_uuids=_job_gpu_uuids(st, job_id),
                                   pid_start=pid_start, before_criu=leave)  # fmt: skip
        finally:
            with _USES_LOCK:  # counted as an image from now on, or not at all
                _DUMPING.pop(job_id, None)
    except Exception as e:  # the instance runs on (unless CRIU ended it): tell it, record why
        reason = str(e) + leave.after_failure(tree_kept=bool(getattr(e, "tree_kept", False)))
        try:
            _set_status(st, job_id, state="failed", pid=pid, reason=reason)
        finally:  # the status first (it reads it when told), but told in any case
            _resume(pid, pid_start)
        st.event("checkpoint.failed", job_id=job_id, uid=identity.uid, reason=reason[:2000])
        _sync_quietly(st)  # an older image of the job was deleted before the dump
        return not pid_alive(pid, pid_start)
    kept = report.kept = report.kept and leave.keep(pid, pid_start, report.key)
    _sync_quietly(st)  # before "saved": a restore must find the entry held
    _set_status(st, job_id, state="saved", pid=pid, key=report.key,
                size_bytes=report.size_bytes, timings_s=report.timings_s,
                kept=kept)  # fmt: skip
    st.event("checkpoint.saved", job_id=job_id, uid=identity.uid, image=report.to_json())
    return True


def _job_gpu_uuids(st: DaemonState, job_id: str) -> list[str]:
    """The UUIDs of the GPUs the prolog recorded for the job's current run (none without
    a driver): what a restore on other GPUs is remapped against."""
    from spswap.checkpoint.gpu_map import job_gpu_uuids, uuids_by_minor

    rec = st.jobs.get(job_id)
    by_minor = uuids_by_minor()
    if rec is None or not rec.gpus or not by_minor:
        return []
    try:
        return job_gpu_uuids(rec.gpus, by_minor)
    except CheckpointFailed as e:  # no remap then: a same-GPU restore still works
        st.event("checkpoint.gpus_unknown", job_id=job_id, reason=str(e))
        return []


def _resume(pid: int, pid_start: int | None) -> None:
    """Tell a parked instance to look at its status (it runs on: the dump failed). Only
    the very process that parked: SIGUSR2 would end another that took over its pid."""
    if not pid_alive(pid, pid_start):
        return
    try:
        os.kill(pid, RESUME_SIGNAL)
    except ProcessLookupError:
        pass


def _requeue(st: DaemonState, job_id: str, *, early: bool = False) -> bool:
    """Requeue as the instance asked: while the dump runs when the instance is parked
    outside the job (``early``), else once the image is complete (a requeue ends the
    job's processes; and the image is worth nothing if the job does not come back).
    False when there is no Slurm to ask or it refused."""
    from spswap.slurm.backend import get_backend

    try:
        backend = get_backend()
        if backend is None:
            return False
        backend.requeue(job_id)
        st.event("job.requeue", job_id=job_id, early=early)
    except Exception as e:  # preemption may have requeued it already, or slurmctld is slow
        st.event("job.requeue_refused", job_id=job_id, reason=str(e)[:500])
        return False  # not known to be leaving: a failed dump sends the instance home
    return True


def op_restore(ctx: Context, args: dict[str, Any]) -> Any:
    """Restore the job's instance for the caller (the new run's proxy)."""
    st = ctx.state
    job_id = args["job_id"]
    rec = _job_for(ctx, job_id)
    _require_running(rec)
    expected = _identity(args, rec.uid)
    # A job requeued while its dump ran may be back before the dump ends: wait for it
    # (also just after "saved": the dump thread still freezes and records a kept tree).
    state = (read_json(_status_path(st, job_id)) or {}).get("state")
    dumping = state in ("dumping", "saved")
    if not _job_lock(job_id).acquire(timeout=RESTORE_WAITS_DUMP_S if dumping else 1.0):
        if dumping:
            raise CheckpointFailed(f"the previous run's dump of job {job_id} did not end "
                                   f"within {RESTORE_WAITS_DUMP_S:g} s: this run starts "
                                   "without it (see `spswap events`)")  # fmt: skip
        raise CheckpointFailed(f"job {job_id} is being checkpointed or restored already")
    try:
        return _restore(ctx, st, rec, job_id, expected, args)
    finally:
        _job_lock(job_id).release()


def _restore(ctx: Context, st: DaemonState, rec: Any, job_id: str, expected: Identity,
             args: dict[str, Any]) -> Any:  # fmt: skip
    status = read_json(_status_path(st, job_id)) or {}
    if status.get("state") != "saved":
        raise CheckpointFailed(no_image_reason(job_id, status))
    from spswap.checkpoint.service import ImageRejected, restore_instance

    with _KEPT_LOCK:  # this restore owns it now: nothing else may end it meanwhile
        kept = _KEPT.pop(job_id, None)
    woken = _wake_kept(st, rec, job_id, expected, kept) if kept is not None else None
    if kept is not None and woken is not None:
        pid, timings, image = woken
        try:
            return _restored(ctx, st, rec, job_id, expected, args, pid, timings, kept=True)
        finally:
            _clear_parking(st, job_id, kept, pid)
            # stale since the tree ran on; deleted once the instance is woken: freeing a
            # few GB of tmpfs pages takes 0.3-0.4 s, off the swap's path here
            from spswap.checkpoint.criu import remove_image

            remove_image(image)
            _sync_quietly(st)
    try:
        pid, timings = restore_instance(st.cfg.paths.images, job_id=job_id, expected=expected,
                                        gpu_uuids=_job_gpu_uuids(st, job_id))  # fmt: skip
    except ImageRejected as e:
        _set_status(st, job_id, state="rejected", reason=str(e))
        st.event("restore.rejected", job_id=job_id, uid=rec.uid, reason=str(e))
        raise
    except Exception as e:
        _set_status(st, job_id, state="failed", reason=str(e))
        st.event("restore.failed", job_id=job_id, uid=rec.uid, reason=str(e)[:2000])
        raise
    finally:
        _sync_quietly(st)  # the image is gone whatever happened
    return _restored(ctx, st, rec, job_id, expected, args, pid, timings)


def _wake_kept(st: DaemonState, rec: Any, job_id: str, expected: Identity,
               kept: _Kept) -> tuple[int, dict[str, float], Path] | None:  # fmt: skip
    """The job's kept instance back: identity check, thaw, CUDA restore and unlock;
    (pid, timings, its image for the caller to delete). None when the tree was gone, or
    died as it was thawed (a kill that waited for the thaw): the image then brings it
    back. Any other failure ends the instance and deletes the image (cold start)."""
    from spswap.checkpoint.criu import remove_image
    from spswap.checkpoint.service import ImageRejected, kept_image, wake_kept

    t0 = time.monotonic()
    image = None
    try:
        if not kept.alive():
            raise _KeptGone
        image = kept_image(st.cfg.paths.images, job_id=job_id, expected=expected)
        timings = {"verify": time.monotonic() - t0}
        t0 = time.monotonic()
        tree = kept.parking.pids()
        if not kept.parking.thaw():
            raise CheckpointFailed(f"the kept instance of job {job_id} could not be thawed")
        timings["thaw"] = time.monotonic() - t0
        if not kept.alive():
            raise _KeptGone
        timings.update(wake_kept(image, kept.pid, gpu_uuids=_job_gpu_uuids(st, job_id),
                                 tree=tree))  # fmt: skip
    except _KeptGone:
        _finish_kept(st, kept, "it was gone when its job came back: restored from its image")
        return None
    except BaseException as e:
        kept.end()
        if image is not None:
            remove_image(image)
        rejected = isinstance(e, ImageRejected)
        reason = str(e) if rejected else f"{e}; the kept instance was ended: cold start"
        _set_status(st, job_id, state="rejected" if rejected else "failed", reason=reason)
        st.event("restore.rejected" if rejected else "restore.failed", job_id=job_id,
                 uid=rec.uid, reason=reason[:2000], kept=True)  # fmt: skip
        raise (e if rejected else CheckpointFailed(reason)) from None
    finally:  # a failure deleted the image: its pool use goes now
        if image is None or not image.exists():
            _sync_quietly(st)
    return kept.pid, timings, image


class _KeptGone(Exception):
    """The kept tree is not there to wake: its image brings it back instead."""


def _clear_parking(st: DaemonState, job_id: str, kept: _Kept, pid: int) -> None:
    """After a kept tree's wake: anything still parked that is not the instance's tree (a
    process that left the tree before the dump) is ended, and the parked cgroups go; a
    tree that could not join its run stays (the start-up sweep ends it)."""
    from spswap.checkpoint.proctree import process_tree_pids

    try:
        leftover = kept.parking.pids() - set(process_tree_pids(pid))
        for p in leftover:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if leftover:
            st.event("checkpoint.parked_killed", job_id=job_id, pids=sorted(leftover))
        deadline = time.monotonic() + 5
        while kept.parking.pids() & leftover and time.monotonic() < deadline:
            time.sleep(0.02)
        kept.parking.remove()
    except OSError:  # the sweep at the next start takes what is left
        pass


def _restored(ctx: Context, st: DaemonState, rec: Any, job_id: str, expected: Identity,
              args: dict[str, Any], pid: int, timings: dict[str, float], *,
              kept: bool = False) -> Any:  # fmt: skip
    """A restored (or kept) instance into the new run: its cgroups, its status, woken."""
    _into_job(st, job_id, pid, ctx.peer_pid)
    # The status first: the woken instance reads it to learn its new run.
    _set_status(st, job_id, state="restored", pid=pid, proxy_pid=ctx.peer_pid,
                restart_count=int(args.get("restart_count", 0)), timings_s=timings,
                kept=kept)  # fmt: skip
    try:
        os.kill(pid, RESUME_SIGNAL)
    except ProcessLookupError:
        # Killed (or OOM) between CRIU's end and our signal: the proxy must cold-start
        # now rather than stand in for nobody.
        reason = (f"the restored instance of job {job_id} (pid {pid}) died before it woke; "
                  "its image is gone (single use, or stale once a kept tree ran on): cold "
                  "start")  # fmt: skip
        _set_status(st, job_id, state="failed", reason=reason)
        st.event("restore.failed", job_id=job_id, uid=rec.uid, reason=reason)
        raise CheckpointFailed(reason) from None
    _hold_pool_entry(st, expected.model_digest, pid, rec)
    st.event("restore.done", job_id=job_id, uid=rec.uid, pid=pid, timings_s=timings, kept=kept)
    return {"pid": pid, "timings_s": timings, "kept": kept}


def _into_job(st: DaemonState, job_id: str, pid: int, proxy_pid: int) -> None:
    """The restored tree (spswapd's child) or woken kept tree (parked) into the new
    run's cgroups, so Slurm tracks, limits and ends it with its job; where that fails it
    runs on, outside (logged)."""
    from spswap.checkpoint import cgroups, proctree

    try:
        moved = cgroups.join(proctree.process_tree_pids(pid), proxy_pid)
        if moved:
            st.event("restore.joined_job", job_id=job_id, pid=pid, hierarchies=moved)
    except Exception as e:  # noqa: BLE001 - the restore stands; the proxy still forwards
        st.event("restore.outside_job", job_id=job_id, pid=pid, reason=str(e)[:500])


def _hold_pool_entry(st: DaemonState, digest: str, pid: int, rec: Any) -> None:
    """The restored process maps its pool entry: record its use (its old use died with the
    dumped process), so the entry is not evicted under it."""
    from spswap.liveness import Holder
    from spswap.pool.store import Pool

    holder = Holder(pid=pid, pid_start=pid_start_time(pid), uid=rec.uid, job_id=rec.job_id)
    try:
        Pool.from_config(st.cfg).acquire_use(digest, holder)
    except Exception as e:  # the restore stands; only eviction protection is missing
        st.event("restore.pool_use_failed", job_id=rec.job_id, reason=str(e)[:500])


def no_image_reason(job_id: str, status: dict[str, Any]) -> str:
    """Why a job's run cannot be restored, from its checkpoint status (shown to the user)."""
    state = status.get("state", "none")
    if state == "none":
        return f"job {job_id} has no checkpoint image (never dumped on this node): cold start"
    if state == "restored":
        return (f"job {job_id}'s image was restored already (it is single use) and that "
                "instance has ended: cold start")  # fmt: skip
    if state == "dumping":
        return f"job {job_id}'s dump has not finished: cold start"
    why = status.get("reason")
    return f"job {job_id} has no saved image (dump {state}" + (f": {why}" if why else "") + \
        "): cold start"


def op_checkpoint_status(ctx: Context, args: dict[str, Any]) -> Any:
    """Where the job's checkpoint stands: dumping, saved, failed, rejected or restored."""
    job_id = args["job_id"]
    _job_for(ctx, job_id)
    return read_json(_status_path(ctx.state, job_id)) or {"job_id": job_id, "state": "none"}


# -- image lifecycle -------------------------------------------------------------------

_USES_LOCK = threading.RLock()  # held by sync_image_uses; _DUMPING changes under it
_DUMPING: dict[str, str] = {}  # job id -> model digest, while this daemon dumps it
RECOVER_WAIT_S = 60.0  # how long start-up waits for a dead daemon's CRIU to let go


def _daemon_holder() -> Any:
    from spswap.liveness import Holder, pid_start_time

    pid = os.getpid()
    return Holder(pid=pid, pid_start=pid_start_time(pid), uid=os.getuid(), job_id=None,
                  since=time.time())  # fmt: skip


def sync_image_uses(st: DaemonState) -> dict[str, int]:
    """Hold exactly one pool use per image on disk (holder: this daemon process).

    An image whose pool entry is gone can never be restored (the process it holds maps
    the entry's file): it is deleted. Returns digest -> uses now held.
    """
    from spswap.checkpoint.service import image_digests
    from spswap.errors import PoolEntryNotFound
    from spswap.pool.store import Pool

    if not st.cfg.paths.pool.is_dir():
        return {}
    me = _daemon_holder()
    with _USES_LOCK:
        pool = Pool.from_config(st.cfg, job_alive=st.job_probe())
        by_digest = image_digests(st.cfg.paths.images)
        want = Counter(d for d in by_digest.values() if d)
        # dumps in progress in this daemon: an early-requeued job's epilog drops the job's
        # own use while CRIU still reads the process that maps the entry
        want.update(d for d in _DUMPING.values() if d)
        have = Counter(e.manifest.digest for e in pool.entries()
                       for h in e.users if _same_holder(h, me))  # fmt: skip
        for digest in set(want) | set(have):
            for _ in range(want[digest] - have[digest]):
                try:
                    pool.acquire_use(digest, me)
                except PoolEntryNotFound:
                    _drop_images_needing(st, by_digest, digest)
                    want[digest] = 0
                    break
            for _ in range(have[digest] - want[digest]):
                pool.release_use(digest, me)
        return {d: n for d, n in want.items() if n}


def _same_holder(a: Any, b: Any) -> bool:
    return (a.pid, a.pid_start, a.uid, a.job_id) == (b.pid, b.pid_start, b.uid, b.job_id)


def _drop_images_needing(st: DaemonState, by_digest: dict[str, str], digest: str) -> None:
    from spswap.checkpoint.criu import remove_image

    for key, d in by_digest.items():
        if d == digest:
            for job_id in [k.job_id for k in list(_KEPT.values()) if k.key == key]:
                _end_kept(st, job_id, "its image was dropped", key=key)
            remove_image(st.cfg.paths.images / key)
            st.event("image.dropped", image=key,
                     reason=f"its pool entry {digest[:12]} is gone: it cannot be restored")


def _sync_quietly(st: DaemonState) -> None:
    """A failed re-count must not fail the dump or restore it follows."""
    try:
        sync_image_uses(st)
    except Exception as e:  # noqa: BLE001 - logged; the next sync tries again
        st.event("image.uses_failed", reason=str(e)[:500])


def drop_job_images(st: DaemonState, job_id: str,
                    reason: str = "the job ended and will not return") -> list[str]:  # fmt: skip
    """Delete the job's images and unfinished dumps (ending its kept tree) and give back
    their pool uses; ``reason`` goes to the events and the checkpoint status."""
    from spswap.checkpoint.service import delete_job_images

    _end_kept(st, job_id, reason)
    gone = delete_job_images(st.cfg.paths.images, job_id)
    if gone:
        status = read_json(_status_path(st, job_id)) or {}
        if status.get("state") in ("saved", "dumping"):
            _set_status(st, job_id, state="deleted", reason=reason)
    _sync_quietly(st)
    return gone


def recover(st: DaemonState) -> dict[str, Any]:
    """Daemon start-up: clean up after a daemon that died (``kill -9``, OOM, reboot of
    the service) and take back the pool uses of the images on disk.

    A status left "dumping" is failed with the reason; when its instance still runs (CRIU
    died with the daemon and let the process go) it is told (SIGUSR2) and exits as after
    any failed dump, its requests saved. If a CRIU of the dead daemon still holds the
    process, that wait happens in a thread so the daemon answers meanwhile.
    """
    from spswap.checkpoint.cgroups import root_tag, sweep
    from spswap.checkpoint.criu import remove_image
    from spswap.checkpoint.service import incomplete_images, temp_dirs

    # first: what a dead daemon left parked outside its job (no home known any more)
    swept = sweep(root_tag(st.cfg.root))
    if swept:
        st.event("checkpoint.parked_swept", cgroups=swept)
    stale = []
    status_dir = st.cfg.paths.run / "checkpoints"
    for path in sorted(status_dir.glob("*.json")) if status_dir.is_dir() else []:
        status = read_json(path) or {}
        if status.get("kept"):  # the sweep above ended what the dead daemon kept
            _not_kept_any_more(st, str(status.get("job_id") or path.stem))
        if status.get("state") == "dumping":
            stale.append((str(status.get("job_id") or path.stem), int(status.get("pid") or 0),
                          status.get("pid_start")))  # fmt: skip
    dumping = {job for job, _, _ in stale}
    removed = []
    images = st.cfg.paths.images
    for p in temp_dirs(images) + incomplete_images(images):
        if not any(_of_job(p, j) for j in dumping):  # those wait for their CRIU to end
            removed.append(remove_image(p))
    for job_id, pid, pid_start in stale:
        threading.Thread(target=_recover_dump, args=(st, job_id, pid, pid_start),
                         daemon=True).start()  # fmt: skip
    _sync_quietly(st)
    if stale or removed:
        st.event("checkpoint.recovered", stale_dumps=[j for j, _, _ in stale], removed=removed)
    return {"stale_dumps": [j for j, _, _ in stale], "removed": removed}


def _of_job(p: Path, job_id: str) -> bool:
    from spswap.checkpoint.service import job_prefix

    return p.name.removeprefix(".tmp-").startswith(job_prefix(job_id))


def _traced(pid: int) -> bool:
    """True while a tracer (a CRIU still dumping) holds ``pid``."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("TracerPid:"):
                return int(line.split()[1]) != 0
    except (OSError, ValueError):
        pass
    return False


def _recover_dump(st: DaemonState, job_id: str, pid: int, pid_start: int | None) -> None:
    from spswap.checkpoint.criu import remove_image
    from spswap.checkpoint.service import incomplete_images, temp_dirs
    from spswap.liveness import pid_alive

    deadline = time.monotonic() + RECOVER_WAIT_S
    while pid > 0 and _traced(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    # the start time rules out a process that took the pid over since (we signal it)
    alive = pid > 0 and pid_start is not None and pid_alive(pid, pid_start)
    for p in temp_dirs(st.cfg.paths.images, job_id) + incomplete_images(st.cfg.paths.images):
        if _of_job(p, job_id):
            remove_image(p)
    fate = "it runs on and was told" if alive else "CRIU had ended it: its requests are saved"
    reason = (f"spswapd died during the dump of job {job_id} (pid {pid}); the unfinished "
              f"image was deleted; {fate}: the next run starts cold")  # fmt: skip
    _set_status(st, job_id, state="failed", pid=pid, reason=reason)
    st.event("checkpoint.failed", job_id=job_id, reason=reason)
    if alive:
        _resume(pid, pid_start)


def job_fate(slurm_state: str | None, requeued: bool | None) -> str:
    """Whether an ended job will run again: "back", "gone" or "unknown".

    ``slurm_state``: the controller's state name (None when Slurm does not know the job
    or cannot be asked); ``requeued``: what the epilog was told, when it was.
    """
    back = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT"}
    gone = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED", "REVOKED"}  # fmt: skip
    state = (slurm_state or "").upper().split()[0] if slurm_state else ""
    if state in back:
        return "back"
    if state in gone:
        return "gone"
    # not known to Slurm, or still COMPLETING (a requeued job looks the same then)
    if requeued is None:
        return "unknown"
    return "back" if requeued else "gone"
