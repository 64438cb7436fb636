"""The ``restore`` op: the job's kept instance woken, or its image restored, into the new
run (see :mod:`spswap.daemon.ckpt_status` for the whole flow)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spswap.checkpoint import cgroup_paths, cgroups, proctree
from spswap.checkpoint.criu import remove_image, remove_image_soon
from spswap.checkpoint.cuda_back import unlock_kept, wake_kept
from spswap.checkpoint.device_rules import Carried
from spswap.checkpoint.images import Identity, pool_digests
from spswap.checkpoint.proctree import process_tree_pids
from spswap.checkpoint.service import kept_image, restore_instance
from spswap.daemon import prewake
from spswap.daemon.ckpt_status import (
    RESUME_SIGNAL,
    identity_of,
    no_image_reason,
    run_gpu_uuids,
    running_job,
)
from spswap.daemon.image_uses import sync_quietly
from spswap.daemon.kept import Kept
from spswap.daemon.protocol import Answer
from spswap.daemon.statuses import CheckpointState
from spswap.errors import CheckpointFailed, ImageRejected, PermissionDenied
from spswap.liveness import Holder, pid_start_time
from spswap.pool.store import Pool

if TYPE_CHECKING:
    from spswap.daemon.jobs import JobRecord
    from spswap.daemon.state import Context, DaemonState


RESTORE_WAITS_DUMP_S = 300.0  # a restore that finds its own job still dumping waits this long


@dataclass(frozen=True)
class Asker:
    """The process that asked for a restore (the new run's proxy), as it was when it
    asked: the tree gets the device rules of these cgroups and joins them, never those
    of a process that took its pid since (a restore takes seconds to minutes)."""

    pid: int
    start: int | None
    cgroups: list[cgroup_paths.Membership]

    @classmethod
    def of(cls, pid: int) -> Asker:
        start = pid_start_time(pid)
        found = cgroup_paths.memberships(pid)
        # read again: a pid that changed hands while its cgroups were read reads as gone
        return cls(pid, start if pid_start_time(pid) == start else None, found)

    def alive(self) -> bool:
        """The same process still runs."""
        return self.start is not None and pid_start_time(self.pid) == self.start


def op_restore(ctx: Context, args: dict[str, Any]) -> Answer:
    """Restore the job's instance for the caller (the new run's proxy)."""
    t0 = time.perf_counter()
    st = ctx.state
    job_id = args["job_id"]
    rec = running_job(ctx, job_id)  # the job's own run only, from here on
    asker = Asker.of(ctx.peer_pid)
    if ctx.peer_uid != 0:
        asking_from_the_job(job_id, asker)
    try:
        answer = _locked_restore(ctx, st, rec, job_id, args, asker)
        # the whole op, its checks and waits too: the asker's round trip less this is IPC
        answer["timings_s"] = {**answer["timings_s"], "daemon_total": time.perf_counter() - t0}
        return answer
    finally:
        # a restore that failed before it took the tree: one woken early would hold GPU
        # memory the run's cold start needs
        prewake.end_if_untaken(st, job_id)


def asking_from_the_job(job_id: str, asker: Asker) -> None:
    """Refuse a user's restore asked from outside the job's cgroup where the job has one:
    the restored instance joins the cgroups of the process that asks (so that Slurm's
    limits and its end-of-job kill cover it), and one asked for from a login shell would
    run outside the job's limits (the job's cgroup is Slurm's, root's: a folder of that
    name in a user's own delegated cgroup is not it). Checked before anything is
    restored: the image stays."""
    pid = asker.pid
    try:
        found_mounts = cgroup_paths.mounts()
        if asker.alive() and cgroup_paths.in_slurm_job(asker.cgroups, job_id, found_mounts):
            return
        job_cgroups = cgroup_paths.job_dirs(job_id, found_mounts)
    except OSError:
        return  # (no cgroups to read: nothing to be outside of)
    if job_cgroups:
        raise PermissionDenied(
            f"pid {pid} asked to restore job {job_id}'s instance from outside the job's "
            f"cgroup ({job_cgroups[0]}): a restored instance joins the cgroups of the "
            "process that asks, so ask from inside the job (its batch script, or `srun "
            f"--jobid={job_id} --overlap ...`); the image stays for that"
        )


def _locked_restore(ctx: Context, st: DaemonState, rec: JobRecord, job_id: str,
                    args: dict[str, Any], asker: Asker) -> dict[str, Any]:  # fmt: skip
    expected = identity_of(args, rec.uid)
    # A job requeued while its dump ran may be back before the dump ends: wait for it
    # (also just after "saved": the dump thread still freezes and records a kept tree).
    state = st.statuses.read(job_id).get("state")
    dumping = state in (CheckpointState.DUMPING, CheckpointState.SAVED)
    # else an early wake under way may hold the lock (0.4-0.9 s on the H200, 0.5B-3B)
    wait_s = RESTORE_WAITS_DUMP_S if dumping else prewake.END_WAIT_S
    if not st.job_locks.of(job_id).acquire(timeout=wait_s):
        if dumping:
            raise CheckpointFailed(f"the previous run's dump of job {job_id} did not end "
                                   f"within {RESTORE_WAITS_DUMP_S:g} s: this run starts "
                                   "without it (see `spswap events`)")  # fmt: skip
        raise CheckpointFailed(
            f"job {job_id} is being checkpointed or restored already (waited {wait_s:g} s)"
        )
    try:
        return _restore(ctx, st, rec, job_id, expected, args, asker)
    finally:
        st.job_locks.of(job_id).release()


def _restore(ctx: Context, st: DaemonState, rec: JobRecord, job_id: str, expected: Identity,
             args: dict[str, Any], asker: Asker) -> dict[str, Any]:  # fmt: skip
    status = st.statuses.read(job_id)
    if status.get("state") != CheckpointState.SAVED:
        raise CheckpointFailed(no_image_reason(job_id, status))

    kept = st.kept.take(job_id)  # this restore owns it now: nothing else may end it meanwhile
    woken = _wake_kept(st, rec, job_id, expected, kept, asker) if kept else None
    if kept is not None and woken is not None:
        pid, timings, image = woken
        try:  # (a tree its image made at the prolog came back from the image: so said)
            return _restored(ctx, st, rec, job_id, expected, args, pid, timings, asker,
                             kept=kept.restored_early_s is None)  # fmt: skip
        finally:
            _clear_parking(st, job_id, kept, pid)
            # stale since the tree ran on; its pages are freed after the reply (a few
            # GB of tmpfs: 0.3-0.4 s that the run's restore waited for)
            remove_image_soon(image)
            sync_quietly(st)
    st.held_cgroups.drop(job_id)  # (restored here, not early: its cgroup is not needed)

    def outside(why: str) -> None:  # (then moved into the run's cgroups: _into_job)
        st.event("restore.criu_outside_job", job_id=job_id, uid=rec.uid, reason=why[:500])

    try:
        # CRIU starts in the run's cgroups: the tree never runs under spswapd's device
        # rules (all GPUs) or outside the job's limits, as it did until it joined the run
        pid, timings = restore_instance(st.cfg.paths.images, job_id=job_id, expected=expected,
                                        gpu_uuids=run_gpu_uuids(st, job_id),
                                        read_content=st.cfg.image_check == "full",
                                        criu_as_user=not st.cfg.criu_as_root,
                                        hugepages=st.cfg.restore_hugepages,
                                        cgroup_dirs=_run_cgroups(asker),
                                        outside=outside)  # fmt: skip
    except ImageRejected as e:
        st.statuses.write(job_id, state=CheckpointState.REJECTED, reason=str(e))
        st.event("restore.rejected", job_id=job_id, uid=rec.uid, reason=str(e))
        raise
    except Exception as e:
        st.statuses.write(job_id, state=CheckpointState.FAILED, reason=str(e))
        st.event("restore.failed", job_id=job_id, uid=rec.uid, reason=str(e)[:2000])
        raise
    finally:
        sync_quietly(st)  # the image is gone whatever happened
    return _restored(ctx, st, rec, job_id, expected, args, pid, timings, asker)


def _run_cgroups(asker: Asker) -> list[Path]:
    """The directories of the cgroups the run's process was in when it asked (none once it
    is gone: the tree is then ended, :func:`_into_job`)."""
    try:
        return cgroups.dirs_of(asker.cgroups) if asker.alive() else []
    except OSError:  # (no mountinfo: restored in spswapd's own, then moved)
        return []


def _wake_kept(st: DaemonState, rec: JobRecord, job_id: str, expected: Identity,
               kept: Kept, asker: Asker) -> tuple[int, dict[str, float], Path] | None:  # fmt: skip
    """The job's kept instance back: identity check, the new run's device rules (of the
    ``asker``'s cgroups) for its parked cgroup, thaw, CUDA restore and unlock; (pid, timings, its
    image for the caller to delete). None when the tree was gone, or died as it was
    thawed (a kill that waited for the thaw): the image then brings it back. Any other
    failure ends the instance and deletes the image (cold start)."""
    t0 = time.monotonic()
    image = None
    what = ("the kept instance" if kept.restored_early_s is None
            else "the instance its image brought back at the job's prolog")  # fmt: skip
    try:
        if not kept.alive():
            raise _KeptGone
        image = kept_image(st.cfg.paths.images, job_id=job_id, expected=expected)
        timings = {f"early_{k}": v for k, v in (kept.restore_timings or {}).items()}
        timings["verify"] = time.monotonic() - t0
        t0 = time.monotonic()
        tree = kept.parking.pids()
        if kept.parking.take_device_rules(asker.cgroups) is Carried.FAILED:
            # as without rules: the thawed tree waits there only for its CUDA restore
            st.event("restore.device_rules_not_carried", job_id=job_id,
                     reason=kept.parking.devices_reason[:500])  # fmt: skip
        if not kept.parking.thaw():
            raise CheckpointFailed(f"{what} of job {job_id} could not be thawed")
        timings["thaw"] = time.monotonic() - t0
        if not kept.alive():
            raise _KeptGone
        if kept.gpu_back_s is not None:  # its GPU state came back at the prolog
            if not prewake.matches_gpus(st, job_id, kept):
                raise _NotWoken("its GPU state was restored early on GPUs its run does not "
                                "have: restored from its image")  # fmt: skip
            timings.update({f"early_{k}": v for k, v in (kept.early_timings or {}).items()})
            timings.update(unlock_kept(image, kept.pid))
        else:
            timings.update(wake_kept(image, kept.pid, gpu_uuids=run_gpu_uuids(st, job_id),
                                     tree=tree))  # fmt: skip
    except _KeptGone:
        st.kept.end_taken(kept, "it was gone when its job came back: restored from its image")
        return None
    except _NotWoken as e:
        st.kept.end_taken(kept, str(e))
        return None
    except BaseException as e:
        kept.kill()
        if image is not None:
            remove_image(image, tree_gone=True)
        rejected = isinstance(e, ImageRejected)
        reason = str(e) if rejected else f"{e}; {what} was ended: cold start"
        st.statuses.write(
            job_id,
            state=CheckpointState.REJECTED if rejected else CheckpointState.FAILED,
            reason=reason,
        )
        st.event("restore.rejected" if rejected else "restore.failed", job_id=job_id,
                 uid=rec.uid, reason=reason[:2000], kept=True)  # fmt: skip
        raise (e if rejected else CheckpointFailed(reason)) from None
    finally:  # a failure deleted the image: its pool use goes now
        if image is None or not image.exists():
            sync_quietly(st)
    return kept.pid, timings, image


class _KeptGone(Exception):
    """The kept tree is not there to wake: its image brings it back instead."""


class _NotWoken(Exception):
    """The kept tree may not be woken for this run (the message says why): it is ended and
    its image brings it back instead."""


def _clear_parking(st: DaemonState, job_id: str, kept: Kept, pid: int) -> None:
    """After a kept tree's wake: anything still parked that is not the instance's tree (a
    process that left the tree before the dump) is ended, and the parked cgroups go; a
    tree that could not join its run stays (the start-up sweep ends it)."""
    try:
        leftover = kept.parking.pids() - set(process_tree_pids(pid))
        proctree.kill_exactly(leftover, lambda p: p in kept.parking.pids())
        if leftover:
            st.event("checkpoint.parked_killed", job_id=job_id, pids=sorted(leftover))
        deadline = time.monotonic() + 5
        while kept.parking.pids() & leftover and time.monotonic() < deadline:
            time.sleep(0.02)
        kept.parking.remove()
    except OSError:  # the sweep at the next start takes what is left
        pass


def _restored(ctx: Context, st: DaemonState, rec: JobRecord, job_id: str, expected: Identity,
              args: dict[str, Any], pid: int, timings: dict[str, float], asker: Asker, *,
              kept: bool = False) -> dict[str, Any]:  # fmt: skip
    """A restored (or kept) instance into the new run: its cgroups, its status, woken."""
    started = time.perf_counter()
    try:
        _into_job(st, job_id, pid, asker)
    except CheckpointFailed as e:
        st.statuses.write(job_id, state=CheckpointState.FAILED, reason=str(e))
        st.event("restore.failed", job_id=job_id, uid=rec.uid, reason=str(e))
        raise
    timings["join_job"] = time.perf_counter() - started  # (its processes' cgroup moves)
    # The status first: the woken instance reads it to learn its new run.
    st.statuses.write(job_id, state=CheckpointState.RESTORED, pid=pid, proxy_pid=ctx.peer_pid,
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
        st.statuses.write(job_id, state=CheckpointState.FAILED, reason=reason)
        st.event("restore.failed", job_id=job_id, uid=rec.uid, reason=reason)
        raise CheckpointFailed(reason) from None
    _hold_pool_entry(st, expected.model_digest, pid, rec)
    st.event("restore.done", job_id=job_id, uid=rec.uid, pid=pid, timings_s=timings, kept=kept,
             came_from="its kept instance" if kept else "its image")  # fmt: skip
    return {"pid": pid, "timings_s": timings, "kept": kept}


def _into_job(st: DaemonState, job_id: str, pid: int, asker: Asker) -> None:
    """The restored tree (spswapd's child) or woken kept tree (parked) into the new
    run's cgroups (the ``asker``'s, as read when it asked), so Slurm tracks, limits and
    ends it with its job; where a move fails it runs on, outside (logged). When the run
    that asked is gone by then, there is no run to join and no one to serve: the tree is
    ended (:class:`CheckpointFailed`), never left running outside any job."""
    tree = proctree.process_tree_pids(pid)
    starts = {p: pid_start_time(p) for p in tree}  # who they are, for _end_tree
    proxy_pid = asker.pid
    if asker.alive():
        try:
            moved = cgroups.join(tree, asker.cgroups)
            if moved:
                st.event("restore.joined_job", job_id=job_id, pid=pid, hierarchies=moved)
        except Exception as e:  # noqa: BLE001 - the restore stands; the proxy still forwards
            st.event("restore.outside_job", job_id=job_id, pid=pid, reason=str(e)[:500])
    if not asker.alive():
        _end_tree(starts)
        raise CheckpointFailed(f"the run of job {job_id} that asked for the restore (pid "
                               f"{proxy_pid}) ended before its instance could join it: the "
                               "restored instance was ended")  # fmt: skip


def _end_tree(starts: dict[int, int | None], timeout_s: float = 10.0) -> None:
    """SIGKILL the tree's processes (pid -> start time when the tree was read: only one
    that is still that process) and wait until they are gone (reaping those that are
    spswapd's children: a CRIU restore's are)."""
    proctree.kill_exactly(starts, lambda p: starts[p] is not None and
                          pid_start_time(p) == starts[p])  # fmt: skip
    deadline = time.monotonic() + timeout_s
    left = set(starts)
    while left and time.monotonic() < deadline:
        for p in list(left):
            try:
                os.waitpid(p, os.WNOHANG)
            except ChildProcessError:
                pass
            if not os.path.exists(f"/proc/{p}"):
                left.discard(p)
        time.sleep(0.02)


def _hold_pool_entry(st: DaemonState, digest: str, pid: int, rec: JobRecord) -> None:
    """The restored process maps its pool entry: record its use (its old use died with the
    dumped process), so the entry is not evicted under it."""
    holder = Holder(pid=pid, pid_start=pid_start_time(pid), uid=rec.uid, job_id=rec.job_id,
                    since=time.time())  # fmt: skip
    for entry in pool_digests(digest):  # (each model's, for a multi-model job)
        try:
            Pool.from_config(st.cfg).acquire_use(entry, holder)
        except Exception as e:  # the restore stands; only eviction protection is missing
            st.event("restore.pool_use_failed", job_id=rec.job_id, reason=str(e)[:500])
