"""A kept tree's GPU state back early: at its job's prolog, before its run asks.

A kept turn's run spends about half a second starting (Python, the CLI, the fork of its
instance) before it asks spswapd for its instance, and the CUDA restore of a sleeping
vLLM engine takes another 0.4-0.7 s after that (H200, 0.5B-3B). When the job comes back
on the very GPUs its tree was dumped on, nothing in the restore needs the run: at the
job's ``job.register`` (its prolog) the daemon thaws the kept tree in its parked cgroup
(whose device rules, carried from the job's last run, allow exactly those GPUs),
restores its CUDA state, which stays LOCKED (no CUDA call of the tree runs), and freezes
it again. The run's restore then only unlocks it (milliseconds) after the rest of the
usual steps (identity check, the new run's device rules, the thaw, the move into the
job). Where slurmd ran no prolog for the run (:mod:`spswap.daemon.missed_prolog`), the
run's own ``job.starting``, sent by ``spswap serve`` before its imports, starts the wake
instead; a wake done or under way is never done twice.

A job without a kept tree whose dump left its image and parked cgroup gets one first, at
the same moment: :mod:`spswap.daemon.prerestore` restores the image into that cgroup.

It is done only where it is safe and cheap to undo:
- the job's GPUs are known and are the dump's, in the same order (no remap: the carried
  device rules name the dump's GPUs);
- no other job holds a slot on them (the early restore takes GPU memory before the
  run's slot is granted: on a GPU shared with another job's model it would take memory
  that job was granted);
- the job's dump is done (status saved) and its tree alive.
A tree woken early that its run does not take (the run starts cold, or never asks) holds
GPU memory outside any slot: it is ended :data:`HOLD_S` after the wake and at its job's
end; the image stays, so a later run still restores from it.

Where the site allows it (``SPSWAP_KEEP_ON_GPU=1``), the same wake runs right after the
dump instead (:func:`wake_early` with ``resident``, from the dump's thread): the tree's
sleeping GPU state goes back onto its GPU and stays there, frozen and locked, while its
job waits, so the job's next run skips the CUDA restore too (:mod:`spswap.daemon.on_gpu`:
how such a tree keeps out of other jobs' slots).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from spswap.checkpoint.cuda_back import cuda_record, wake_kept
from spswap.daemon import on_gpu
from spswap.daemon.ckpt_status import run_gpu_uuids
from spswap.daemon.prerestore import restore_early
from spswap.daemon.statuses import CheckpointState

if TYPE_CHECKING:
    from spswap.daemon.kept import Kept
    from spswap.daemon.state import DaemonState

HOLD_S = 60.0  # a tree woken early that its run has not taken by then is ended
END_WAIT_S = 15.0  # how long an end waits for an early wake in progress


def refusal(*, dumped_gpus: list[str], cuda_pids: list[int], job_gpus: list[str],
            shared_with: list[str]) -> str | None:  # fmt: skip
    """Why a kept tree is not woken early, or None. ``dumped_gpus``: the GPU UUIDs its
    dump recorded; ``cuda_pids``: its processes with GPU state; ``job_gpus``: the UUIDs of
    the job's GPUs now; ``shared_with``: other jobs holding slots on them. Pure."""
    if not cuda_pids:
        return "no GPU state to restore"
    if not job_gpus or not dumped_gpus:
        return "the job's GPUs are not known"
    if job_gpus != dumped_gpus:
        return "the job is on other GPUs than its dump (the restore remaps them)"
    return on_gpu.shared_text(sorted(shared_with))


def start(st: DaemonState, job_id: str) -> None:
    """At the job's prolog (or its run's ``job.starting``): wake its kept tree's GPU state
    early, off the caller's path."""
    threading.Thread(target=wake_early, args=(st, job_id), daemon=True).start()


def wake_early(st: DaemonState, job_id: str, *, resident: bool = False) -> bool:
    """The job's kept tree (or, without one, its image restored into one: prerestore):
    thawed, its GPU state restored (LOCKED) and frozen again, for its run's restore to
    unlock; True when its GPU state was woken. Never raises. A failure before the thaw
    leaves the tree kept as it was; one after it ends the tree (its GPU state may be half
    back; its image stays: the run restores from it). ``resident``: after the job's dump
    (a kept tree only), to stay on its GPU until its run takes it (no :data:`HOLD_S`)."""
    lock = st.job_locks.of(job_id)
    if not lock.acquire(blocking=False):  # a dump or the run's restore: not now
        return False
    woken = False
    try:
        if st.statuses.read(job_id).get("state") != CheckpointState.SAVED:
            st.held_cgroups.drop(job_id)  # (no image to restore into it)
            return False
        # no kept tree: its image made one, where the dump held its cgroup (prerestore)
        kept = st.kept.take(job_id) or (None if resident else restore_early(st, job_id))
        if kept is None:
            return False
        if kept.early_timings is not None:  # woken already (the prolog's, then the run's)
            st.kept.add(kept)
            return False
        woken = _wake_taken(st, job_id, kept, resident=resident)
        if resident or (not woken and kept.restored_early_s is None):
            return woken  # (kept as it was, or ended; or kept on its GPU: no hold time)
        # woken or restored early (early_s set): ended unless its run takes it soon
        timer = threading.Timer(HOLD_S, end_if_untaken, args=(st, job_id, kept.early_s()),
                                kwargs={"wait_s": END_WAIT_S})  # fmt: skip
        timer.daemon = True  # never holds spswapd's exit
        timer.start()
    finally:
        lock.release()
    if woken:
        st.event_quietly("restore.woken_early", job_id=job_id, pid=kept.pid,
              timings_s=kept.early_timings)  # fmt: skip
    return woken


def _wake_taken(st: DaemonState, job_id: str, kept: Kept, *, resident: bool = False) -> bool:
    """Wake the GPU state of ``kept`` (taken by the caller) where it may; True when done.
    The tree goes back to the kept trees unless the wake failed (then it is ended)."""
    try:
        ready = _ready(st, job_id, kept, resident=resident)
    except Exception:  # noqa: BLE001 - nothing was touched: it stays kept
        ready = None
    if ready is None:
        st.kept.add(kept)
        return False
    try:
        _wake(kept, ready)
    except Exception as e:  # noqa: BLE001 - never into the prolog's daemon thread
        st.kept.end_taken(kept, f"its early wake failed ({e}): its next run restores "
                                "from the image")  # fmt: skip
        return False
    # the job may have ended meanwhile (its images collected without this tree)
    if st.statuses.read(job_id).get("state") != CheckpointState.SAVED or not ready.is_dir():
        st.kept.end_taken(kept, "its job's image went while its GPU state was restored "
                                "early")  # fmt: skip
        return False
    if not resident:
        st.kept.add(kept)
        return True
    return on_gpu.keep(st, job_id, kept, ready)


def _ready(st: DaemonState, job_id: str, kept: Kept, *, resident: bool = False) -> Path | None:
    """The kept tree's image when its GPU state may be woken early, else None (and why
    not, in the event log, for a tree that has GPU state)."""
    image = st.cfg.paths.images / kept.key
    record = cuda_record(image)
    why_not = refusal(dumped_gpus=list(record.get("gpu_uuids", [])),
                      cuda_pids=list(record.get("cuda_pids", [])),
                      job_gpus=run_gpu_uuids(st, job_id),
                      shared_with=on_gpu.shared_with(st, job_id))  # fmt: skip
    if why_not is None and not (image.is_dir() and kept.alive()):
        why_not = "its image or its tree is gone"
    if why_not is None:
        return image
    if record.get("cuda_pids"):  # (a tree without GPU state has nothing to wake)
        st.event_quietly("kept.not_on_gpu" if resident else "restore.not_woken_early",
                         job_id=job_id, reason=why_not)  # fmt: skip
    return None


def _wake(kept: Kept, image: Path) -> None:
    t0 = time.monotonic()
    tree = kept.parking.pids()
    if not kept.parking.thaw():
        raise RuntimeError("the tree could not be thawed")
    timings = wake_kept(image, kept.pid, tree=tree, unlock=False)
    if not kept.parking.freeze():
        raise RuntimeError("the tree could not be frozen again")
    kept.gpu_back_s = time.time()
    kept.early_timings = {**timings, "wake_total": time.monotonic() - t0}


def matches_gpus(st: DaemonState, job_id: str, kept: Kept) -> bool:
    """Whether a tree woken early may be unlocked in the job's run: the run is on the GPUs
    its dump recorded (the wake restored it there, without a remap)."""
    recorded = list(cuda_record(st.cfg.paths.images / kept.key).get("gpu_uuids", []))
    return recorded == run_gpu_uuids(st, job_id)


def end_if_untaken(st: DaemonState, job_id: str, woken_s: float | None = None, *,
                   wait_s: float = 0.0, keep_resident: bool = False) -> bool:  # fmt: skip
    """End the job's kept tree if its GPU state was woken early, or it was restored early
    from its image (at ``woken_s`` when given), and no run took it: it holds GPU memory
    outside any slot, or host memory beside its image. True when ended.
    ``wait_s``: how long to wait for the job's lock (an early wake in progress); without
    it, nothing is waited for (the epilog's path: the job's dump may hold the lock).
    ``keep_resident``: not one kept on its GPU on purpose (the epilog of the run it was
    dumped from: it waits there for the job's next run)."""
    found = st.kept.get(job_id)
    if found is None or found.early_s() is None or (keep_resident and found.resident):
        return False
    lock = st.job_locks.of(job_id)
    got = lock.acquire(timeout=wait_s) if wait_s else lock.acquire(blocking=False)
    if not got:  # a restore holds it: it owns the tree (takes or ends it)
        return False
    try:
        kept = st.kept.take(job_id)
        if kept is None:
            return False
        early_s = kept.early_s()
        if (early_s is None or (woken_s is not None and early_s != woken_s)
                or (keep_resident and kept.resident)):  # fmt: skip
            st.kept.add(kept)
            return False
        what = "its GPU state was" if kept.gpu_back_s is not None else "it was"
        st.kept.end_taken(kept, f"{what} restored early for its job's run, which did not take "
                                "it: ended; its image stays")  # fmt: skip
        return True
    finally:
        lock.release()
