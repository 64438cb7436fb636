"""The ``checkpoint`` op: dump a job's instance (CUDA checkpoint + CRIU) in a thread,
parked outside its job's cgroups while CRIU runs (requeued at once when it asked), and
kept alive beside its image when it fits the keep budget (see :mod:`spswap.daemon.ckpt_status`
for the whole flow)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spswap.checkpoint import cgroups, link_remap, proctree
from spswap.checkpoint.criu import criu_setting, find_criu, missing_text
from spswap.checkpoint.image_layout import layout_summary_quietly
from spswap.checkpoint.images import Identity
from spswap.checkpoint.proctree import anon_rss_bytes
from spswap.checkpoint.service import DumpReport, dump_instance
from spswap.daemon import prewake
from spswap.daemon.ckpt_status import (
    identity_of,
    resume,
    run_gpu_uuids,
    running_job,
)
from spswap.daemon.image_room import ImageOnNode
from spswap.daemon.image_uses import drop_job_images, sync_quietly
from spswap.daemon.jobs import JobState
from spswap.daemon.kept import Kept
from spswap.daemon.protocol import Answer
from spswap.daemon.statuses import CheckpointState
from spswap.errors import CheckpointFailed, PermissionDenied
from spswap.liveness import pid_alive, pid_start_time
from spswap.slurm.backend import get_backend
from spswap.units import fmt_bytes

if TYPE_CHECKING:
    from spswap.checkpoint.cgroups import Parking
    from spswap.daemon.state import Context, DaemonState


def op_checkpoint(ctx: Context, args: dict[str, Any]) -> Answer:
    """Dump the caller (its own process; root may name another pid)."""
    st = ctx.state
    job_id = args["job_id"]
    rec = running_job(ctx, job_id)
    pid = int(args.get("pid") or ctx.peer_pid)
    if ctx.peer_uid != 0 and pid != ctx.peer_pid:
        raise PermissionDenied("a user may checkpoint only the calling process itself: leave out "
                          "pid")  # fmt: skip
    pid_start = pid_start_time(pid)
    identity = identity_of(args, rec.uid)

    setting = criu_setting()  # the settings file read once, for the search and the message
    if find_criu(setting=setting) is None:
        raise CheckpointFailed(f"{missing_text(setting)} (see spswap doctor)")
    # held until the dump thread ends (it releases it)
    if not st.job_locks.of(job_id).acquire(blocking=False):
        raise CheckpointFailed(f"job {job_id} is being checkpointed or restored already")
    # the job's earlier kept instance would otherwise outlive the image the dump replaces
    st.kept.end(job_id, "the job dumps again")
    st.held_cgroups.drop(job_id)
    st.statuses.write(job_id, state=CheckpointState.DUMPING, pid=pid, pid_start=pid_start,
                      uid=rec.uid)  # fmt: skip
    st.dumping.hold(job_id, identity.model_digest)  # the entry, while the dump runs
    st.event("checkpoint.start", job_id=job_id, uid=rec.uid, pid=pid)
    requeue = bool(args.get("requeue"))
    threading.Thread(target=_dump_locked, args=(st, job_id, pid, pid_start, identity, requeue),
                     daemon=True).start()  # fmt: skip
    return {"accepted": True, "pid": pid}


def _dump_locked(st: DaemonState, job_id: str, pid: int, pid_start: int | None,
                 identity: Identity, requeue: bool) -> None:  # fmt: skip
    leave = _LeaveJob(st, job_id, requeue)
    try:
        try:
            gone, report = _dump(st, job_id, pid, pid_start, identity, leave)
        finally:
            leave.close()
    finally:
        st.job_locks.of(job_id).release()  # a restore may come at once: Slurm calls are slow
    if leave.kept:  # outside the job lock: ending other jobs' trees takes time
        st.kept.trim_to(st.cfg.keep_budget_bytes())
    if requeue and gone and not leave.early:
        # only once the process is gone (saved, or lost after CRIU ended it): the image is
        # worth nothing if the job does not come back, and a cold start needs it back too
        _requeue(st, job_id)
    if report is not None:
        _record_layout(st, job_id, identity.uid, report)
    if leave.kept and st.cfg.keep_on_gpu:  # its sleeping GPU state back on its GPU, to
        prewake.wake_early(st, job_id, resident=True)  # wait there (after the layout: its lock)


def _record_layout(st: DaemonState, job_id: str, uid: int, report: DumpReport) -> None:
    """What the saved image holds by kind of memory (:mod:`image_layout`), in a
    ``checkpoint.layout`` event of its own: reading a vLLM image's records takes 0.1-0.3 s
    of Python, which must delay neither "saved" nor a restore that comes at once, so it
    is read last, outside the job lock, and not at all once a restore (or `spswap images
    rm`) of the job holds its lock: that one's own Python steps would wait for this
    thread's. No event either where the image is gone or cannot be read so; one deleted
    while it is read may give a partial count (a detail for reports, never a check)."""
    if st.job_locks.of(job_id).locked():
        return
    t0 = time.monotonic()
    layout = layout_summary_quietly(report.path)
    if layout is not None:
        dumped = sum(layout["bytes_by_kind"].values())  # (what `images show` calls dumped)
        st.event_quietly("checkpoint.layout", job_id=job_id, uid=uid, key=report.key,
                         dumped_bytes=dumped, layout=layout,
                         read_s=round(time.monotonic() - t0, 4))  # fmt: skip


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
        self.kept = False  # the dumped tree is kept alive (see :class:`Kept`)

    def before_cuda(self, tree: list[int]) -> bool:
        """Park before the CUDA checkpoint when the parked cgroup keeps the job's device
        rules: the job may then end (and the next one start) while the GPU state is
        saved. True when parked."""
        try:
            self._leave(tree, need_device_rules=True)
        except Exception as e:  # noqa: BLE001 - must not raise: parked after it instead
            self._event("checkpoint.stays_in_job", reason=str(e)[:500])
        return self.parking is not None

    def __call__(self, tree: list[int]) -> list[tuple[Path, str]] | None:  # before_criu
        """Park (unless :meth:`before_cuda` did). When the dumped tree is to be kept
        alive (:class:`Kept`: a parked tree that fits the keep budget), the writes that
        freeze its parked cgroup, which CRIU makes before it lets the tree go; None
        otherwise."""
        try:
            if self.parking is None:
                self._leave(tree, need_device_rules=False)
            if self.parking is None:
                return None  # not parked out of its job: never kept
            budget = self.st.cfg.keep_budget_bytes()
            # (the tree's size is read from /proc only where a budget can keep it: the
            # dump waits for this)
            why = _not_kept_because(budget, anon_rss_bytes(tree) if budget > 0 else 0,
                                    set_bytes=self.st.cfg.keep_bytes)  # fmt: skip
            if why is None and not link_remap.in_root_dirs(link_remap.deleted_but_linked(tree)):
                # CRIU's post-dump step links files only in root's directories
                why = "it has a deleted file open outside root's directories"
            if why is not None:
                self._event("checkpoint.not_kept", reason=f"{why}: its image brings it back")
                return None
            writes = self.parking.freeze_writes()
            return writes or None
        except Exception as e:  # noqa: BLE001 - must not raise: the dump goes on regardless
            self._event("checkpoint.stays_in_job", reason=str(e)[:500])
            return None

    def _leave(self, tree: list[int], *, need_device_rules: bool) -> None:
        self.parking = _park_out_of_job(self.st, self.job_id, tree, need_device_rules)
        if self.parking is not None and self.requeue:
            sync_quietly(self.st)  # the entry held for the dump before the epilog runs
            self.early = _requeue(self.st, self.job_id, early=True)
        if self.parking is not None and (self.early or not self.requeue):
            # the run may end now (spswap.serve.run_watch): nothing of the job's end
            # waits on the tree any more, and a requeue it asked for is made. Unmarked
            # (a full tmpfs), the run just ends at KillWait as it did before
            try:
                self.st.statuses.mark_left_job(self.job_id, requeued=self.early)
            except OSError as e:
                self._event("checkpoint.left_job_unmarked", reason=str(e)[:500])

    def after_failure(self, tree_kept: bool = False) -> str:
        """A failed dump: the instance back into its job, where it runs on; ended when
        the job was requeued already or its cgroup is gone, or when the failure came after
        a CRIU run that left it running without its GPU state (``tree_kept``). Returns
        what to add to the reason."""
        if self.parking is None:
            return ""
        if tree_kept:
            self.parking.kill_all()
            return (
                "; the instance, left without its GPU state, was ended (its saved "
                "requests are kept)"
            )
        if self.early:
            self.parking.kill_all()
            return ("; the job had been requeued when it left its job for the dump, so "
                    "the instance was ended: its next run starts without the image (its "
                    "saved requests are kept)")  # fmt: skip
        if self.parking.return_home():
            self.parking.kill_all()
            return "; its job's cgroup was gone, so the instance was ended"
        return ""

    def close(self) -> None:
        """After the dump: unless the tree is kept, whatever is still parked (a fork that
        left the tree, or a tree that could not be kept) is ended, and the parked cgroups
        go, or, emptied, are held for the job's image when it was saved and they enforce
        the job's device rules (spswap.daemon.prerestore restores it into them early).
        Never raises (the job lock is released after it)."""
        if self.parking is None or self.kept:
            return
        try:
            killed = self.parking.kill_all()
            saved = self.st.statuses.read(self.job_id).get("state") == CheckpointState.SAVED
            # thawed: CRIU's post-dump step may have frozen it, and a process that enters
            # a frozen cgroup stops there (the early restore's CRIU would, before its exec)
            if saved and self.parking.holds_device_rules and self.parking.thaw():
                self.st.held_cgroups.hold(self.job_id, self.parking)
            else:
                self.parking.remove()
            if killed:
                self._event("checkpoint.parked_killed", pids=killed)
        except Exception:  # noqa: BLE001,S110 - start-up's sweep takes what is left
            pass

    def keep(self, pid: int, pid_start: int | None, key: str) -> bool:
        """After a dump that left the tree running: check it is frozen where it is parked
        (CRIU's post-dump step froze it) and record it; False (:meth:`close` then ends it,
        the image stays) when it is gone or not frozen: it must not run outside a job."""
        t0 = time.monotonic()
        if not pid_alive(pid, pid_start) or not self.parking.freeze():
            self._event(
                "checkpoint.not_kept",
                pid=pid,
                reason="the dumped instance could not be frozen where it waits",
            )
            return False
        kept = Kept(self.job_id, pid, pid_start, self.parking, key, time.time())
        self.st.kept.add(kept)
        self.kept = True
        self._event("checkpoint.kept", pid=pid, size_bytes=kept.size_bytes(),
                    freeze_s=round(time.monotonic() - t0, 4))  # fmt: skip
        return True

    def _event(self, kind: str, **fields: Any) -> None:
        self.st.event_quietly(kind, job_id=self.job_id, **fields)  # (never costs the dump)


def _not_kept_because(budget_bytes: int, tree_bytes: int, *,
                      set_bytes: int | None) -> str | None:  # fmt: skip
    """Why a parked tree of ``tree_bytes`` is not kept alive under the keep budget, or
    None; ``set_bytes``: SPSWAP_KEEP_BYTES as set (None: its default, 1/8 of the node's
    memory). Pure. (A tree larger than the whole budget would be ended at once.)"""
    if set_bytes is None:
        budget = "the keep budget (SPSWAP_KEEP_BYTES unset: 1/8 of the node's memory, {})"
    else:
        budget = "SPSWAP_KEEP_BYTES ({})"
    if budget_bytes <= 0:
        if set_bytes == 0:
            return "SPSWAP_KEEP_BYTES is 0: no instance is kept alive on this node"
        return "the keep budget is 0 (SPSWAP_KEEP_BYTES unset and the node's memory unknown)"
    if tree_bytes > budget_bytes:
        return (f"it holds {fmt_bytes(tree_bytes)} of memory, more than "
                f"{budget.format(fmt_bytes(budget_bytes))} keeps alive")  # fmt: skip
    return None


def _park_out_of_job(st: DaemonState, job_id: str, tree: list[int],
                     need_device_rules: bool) -> Parking | None:  # fmt: skip
    """The tree moved into a parked cgroup of spswapd's (see _LeaveJob), or None; with
    ``need_device_rules``, None also when the parked cgroup could not get the job's
    device rules (it is parked later, after the CUDA checkpoint closed its GPUs)."""
    parking = cgroups.Parking.create(f"{cgroups.root_tag(st.cfg.root)}-{job_id}-{tree[0]}",
                                     tree[0])  # fmt: skip
    if parking is None:
        return None
    if need_device_rules and not parking.holds_device_rules:
        st.event("checkpoint.device_rules_not_carried", job_id=job_id,
                 reason=parking.devices_reason[:500])  # fmt: skip
        parking.remove()
        return None
    try:
        new = tree

        def tree_now() -> set[int]:  # what is still the tree's once moved (pids not reused)
            return set(proctree.process_tree_pids(tree[0]))

        for _ in range(3):  # again for anything forked meanwhile
            parking.adopt(new, members=tree_now)
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
             cgroups=[str(d) for d in parking.dirs.values()],
             device_rules=parking.devices.value)  # fmt: skip
    return parking


def _dump(st: DaemonState, job_id: str, pid: int, pid_start: int | None, identity: Identity,
          leave: _LeaveJob) -> tuple[bool, DumpReport | None]:  # fmt: skip
    """Dump and record the outcome; True when the instance is gone (dumped, or killed by
    CRIU before a later step failed), False when it runs on; with the dump's report when
    it was saved."""
    try:
        try:
            report = dump_instance(st.cfg.paths.images, job_id=job_id, pid=pid,
                                   identity=identity, gpu_uuids=run_gpu_uuids(st, job_id),
                                   pid_start=pid_start, before_criu=leave,
                                   criu_as_user=not st.cfg.criu_as_root,
                                   freeze_tag=cgroups.root_tag(st.cfg.root),
                                   before_cuda=leave.before_cuda,
                                   make_room=lambda tree: _make_room(st, job_id, identity.uid,
                                                                     tree))  # fmt: skip
        finally:
            st.dumping.end(job_id)  # counted as an image from now on, or not at all
            st.image_room.release(job_id)
    except Exception as e:  # the instance runs on (unless CRIU ended it): tell it, record why
        reason = str(e) + leave.after_failure(tree_kept=bool(getattr(e, "tree_kept", False)))
        try:
            st.statuses.write(job_id, state=CheckpointState.FAILED, pid=pid, reason=reason)
        finally:  # the status first (it reads it when told), but told in any case
            resume(pid, pid_start)
        st.event("checkpoint.failed", job_id=job_id, uid=identity.uid, reason=reason[:2000])
        sync_quietly(st)  # an older image of the job was deleted before the dump
        return not pid_alive(pid, pid_start), None
    kept = report.kept = report.kept and leave.keep(pid, pid_start, report.key)
    sync_quietly(st)  # before "saved": a restore must find the entry held
    st.statuses.write(job_id, state=CheckpointState.SAVED, pid=pid, key=report.key,
                      uid=identity.uid,  # (whose budget it counts in: spswap status)
                      size_bytes=report.size_bytes, timings_s=report.timings_s,
                      kept=kept)  # fmt: skip
    st.event("checkpoint.saved", job_id=job_id, uid=identity.uid, image=report.to_json())
    return True, report


def _make_room(st: DaemonState, job_id: str, uid: int, tree: list[int]) -> None:
    """Room for the job's image under the node's image budget (see
    :mod:`spswap.daemon.image_room`): the tree's memory, its GPU state now among it, is
    what CRIU will write."""

    def may_drop(image: ImageOnNode) -> bool:
        if st.job_locks.of(image.job_id).locked():  # being restored (or dumped) now
            return False
        rec = st.jobs.get(image.job_id)  # a job running here is about to take its image
        return rec is None or rec.state is not JobState.RUNNING

    def drop(images: list[ImageOnNode], over: str) -> None:
        for image in images:
            lock = st.job_locks.of(image.job_id)
            if not lock.acquire(blocking=False):  # taken since may_drop looked: it stays
                continue
            try:
                reason = (f"dropped to make room for the image of job {job_id}, of the same "
                          f"user ({over})")  # fmt: skip
                drop_job_images(st, image.job_id, reason)
                st.event_quietly("images.dropped", job_id=image.job_id, for_job=job_id,
                                 size_bytes=image.size_bytes, reason=reason)  # fmt: skip
            finally:
                lock.release()

    st.image_room.make_room(job_id, uid, anon_rss_bytes(tree), drop=drop, may_drop=may_drop)


def _requeue(st: DaemonState, job_id: str, *, early: bool = False) -> bool:
    """Requeue as the instance asked: while the dump runs when the instance is parked
    outside the job (``early``), else once the image is complete (a requeue ends the
    job's processes; and the image is worth nothing if the job does not come back).
    False when there is no Slurm to ask or it refused."""
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
