"""Kept trees whose sleeping GPU state waits on their GPU (``SPSWAP_KEEP_ON_GPU=1``).

Right after a kept dump, :func:`spswap.daemon.prewake.wake_early` with ``resident`` puts
the tree's GPU state back on its GPU (CUDA restore, left LOCKED; the tree frozen again)
and hands it to :func:`keep`: the job's next run then only unlocks it. Such a tree holds
GPU memory outside any slot, on a GPU Slurm gives to other jobs meanwhile, so the slot
table's promise is kept by moving that state back into the tree's host memory (a CUDA
checkpoint, as at its dump: a kept tree as any other, its next run restores its GPU state
itself) whenever another job holds a slot there:

- :func:`keep`: a slot granted on its GPU while it was being woken is seen as it is kept
  (the check and the add under the kept trees' lock, so that a grant either is seen
  there or sees the tree in :func:`make_way`);
- :func:`make_way`: after each slot reservation granted on a GPU, the trees other jobs
  keep there move off it, each in a thread of its own (0.3-0.6 s of CUDA checkpoint: the
  reservation is not made to wait for it).

Where the move fails the tree is ended; its image stays the way back in every case.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

from spswap.checkpoint.cuda_back import put_back_kept

if TYPE_CHECKING:
    from spswap.daemon.kept import Kept
    from spswap.daemon.state import DaemonState

# How long a move off waits for the job's lock: the wake that keeps the tree holds it a
# few more milliseconds after the tree is among the kept trees (where make_way sees it);
# a restore of the job holds it while it takes the tree (then there is nothing to move)
MOVE_WAIT_S = 15.0


def shared_with(st: DaemonState, job_id: str) -> list[str]:
    """The other jobs that hold slots on the job's GPUs now ("?" for a user outside any)."""
    mine = set(_gpus(st, job_id))
    return sorted({r.holder.job_id or "?" for r in st.slot_table().reservations()
                   if r.holder.job_id != job_id and mine & set(r.gpus)})  # fmt: skip


def _gpus(st: DaemonState, job_id: str) -> list[int]:
    """The job's GPUs (as its prolog recorded them)."""
    rec = st.jobs.get(job_id)
    return list(rec.gpus) if rec is not None else []


def shared_text(shared: list[str]) -> str | None:
    """Why a tree may not hold GPU memory beside these jobs' slots (None: no such job)."""
    return f"job(s) {', '.join(shared)} hold slots on its GPUs" if shared else None


def keep(st: DaemonState, job_id: str, kept: Kept, image: Path) -> bool:
    """``kept`` (taken by the caller, under its job's lock), its GPU state just restored
    onto its GPU and LOCKED, back among the kept trees to wait there; True when it does.
    Where another job holds a slot on its GPU by now, its GPU state goes back to host
    memory first (a kept tree as after its dump)."""
    kept.resident = True
    st.statuses.mark_on_gpu(job_id)  # (before it can be moved off: that unmarks it)
    why_not = st.kept.add_unless(kept, lambda: shared_text(shared_with(st, job_id)))
    if why_not is None:
        st.event_quietly("kept.on_gpu", job_id=job_id, pid=kept.pid, gpus=_gpus(st, job_id),
                         timings_s=kept.early_timings)  # fmt: skip
        return True
    _move_off_taken(st, job_id, kept, image, why_not)
    return False


def make_way(st: DaemonState, job_id: str | None, gpus: Collection[int]) -> list[str]:
    """After a slot reservation of job ``job_id`` (None: a user outside any job) was
    granted on ``gpus``: the trees other jobs keep on those GPUs move their GPU state back
    to host memory (the slot table promised that memory to the reservation), each in a
    thread of its own. Returns those jobs."""
    who = f"job {job_id}" if job_id else "a user outside any job"
    moving = []
    for kept in st.kept.resident():
        rec = st.jobs.get(kept.job_id)
        if kept.job_id == job_id or (rec is not None and not set(rec.gpus) & set(gpus)):
            continue  # (its GPUs unknown: moved, to be safe)
        why = f"{who} reserved a slot on its GPU"
        threading.Thread(target=move_off, args=(st, kept.job_id, why), daemon=True).start()
        moving.append(kept.job_id)
    return moving


def move_off(st: DaemonState, job_id: str, why: str, wait_s: float = MOVE_WAIT_S) -> bool:
    """Move the job's tree kept on its GPU off it (see :func:`make_way`); True when moved.
    Nothing is done where the job's restore took the tree (its run takes that memory in
    its own slot) or it no longer waits on the GPU. ``wait_s``: for the job's lock."""
    lock = st.job_locks.of(job_id)
    if not lock.acquire(timeout=wait_s):  # (a restore that holds it this long owns it)
        return False
    try:
        kept = st.kept.take(job_id)
        if kept is None:
            return False
        if not kept.resident:
            st.kept.add(kept)
            return False
        return _move_off_taken(st, job_id, kept, st.cfg.paths.images / kept.key, why)
    finally:
        lock.release()


def _move_off_taken(st: DaemonState, job_id: str, kept: Kept, image: Path, why: str) -> bool:
    """Thaw, CUDA checkpoint, freeze: ``kept`` (taken, under its job's lock) as after its
    dump, back among the kept trees; ended where that fails (its image stays)."""
    try:
        if not kept.parking.thaw():
            raise RuntimeError("the tree could not be thawed")
        timings = put_back_kept(image, kept.pid)
        if not kept.parking.freeze():
            raise RuntimeError("the tree could not be frozen again")
    except Exception as e:  # noqa: BLE001 - a daemon thread: the tree is ended instead
        st.kept.end_taken(kept, f"{why}, where its GPU state was kept, and that state could "
                                f"not go back to host memory ({e}): its next run restores "
                                "from the image")  # fmt: skip
        return False
    kept.resident = False
    kept.gpu_back_s = kept.early_timings = None
    st.kept.add(kept)
    st.statuses.unmark_on_gpu(job_id)
    st.event_quietly("kept.off_gpu", job_id=job_id, pid=kept.pid, gpus=_gpus(st, job_id),
                     timings_s=timings,
                     reason=f"{why}: its GPU state went back to host memory (kept as after "
                            "its dump)")  # fmt: skip
    return True
