"""Kept instances: dumped trees left alive and frozen beside their images, so the job's
next run skips CRIU's restore; kept within the node's keep budget. The daemon object
owns the one :class:`KeptTrees` (``DaemonState.kept``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spswap.checkpoint import proctree
from spswap.liveness import pid_alive

if TYPE_CHECKING:
    from spswap.daemon.statuses import CheckpointStatuses


@dataclass
class Kept:
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
    # its GPU state restored early (LOCKED, frozen again: spswap.daemon.prewake): when
    gpu_back_s: float | None = None
    early_timings: dict[str, float] | None = None
    # made from its image at its job's prolog (spswap.daemon.prerestore): when, the steps'
    # timings; its run's record says "image", not "kept"
    restored_early_s: float | None = None
    restore_timings: dict[str, float] | None = None
    # its GPU state put back on its GPU right after its dump, to stay there while its job
    # waits (SPSWAP_KEEP_ON_GPU; spswap.daemon.prewake): not ended for not being taken soon
    resident: bool = False

    def early_s(self) -> float | None:
        """When it was woken or restored early for its job's run (None: neither); such a
        tree holds memory (GPU, or host beside its image) for that run only."""
        return self.gpu_back_s or self.restored_early_s

    def alive(self) -> bool:
        return pid_alive(self.pid, self.pid_start) and self.pid in self.parking.pids()

    def size_bytes(self) -> int:
        return proctree.anon_rss_bytes(self.parking.pids())

    def kill(self) -> list[int]:
        """Kill the tree (frozen or not) and remove its cgroups; the pids it had. Only the
        processes: :meth:`KeptTrees.end` also says so in the job's status and the log."""
        killed = self.parking.kill_all()
        self.parking.remove()
        return killed


class KeptTrees:
    """The trees this daemon keeps, one per job at most. A tree comes in with
    :meth:`add` (after its job's dump) and leaves either taken by a restore
    (:meth:`take`: the restore owns it then, nothing else may end it) or ended
    (:meth:`end`, :meth:`end_taken`: killed, its job's status no longer says kept, and a
    ``kept.ended`` event gives the reason)."""

    def __init__(self, statuses: CheckpointStatuses, event: Callable[..., None]) -> None:
        self._statuses = statuses
        self._event = event
        self._by_job: dict[str, Kept] = {}
        self._lock = threading.Lock()

    def add(self, kept: Kept) -> None:
        """A tree kept after its job's dump (replacing none: the dump ended the job's last)."""
        with self._lock:
            self._by_job[kept.job_id] = kept

    def add_unless(self, kept: Kept, why_not: Callable[[], str | None]) -> str | None:
        """:meth:`add`, unless ``why_not()``, asked under this object's lock (so that one
        who looks at the trees after what ``why_not`` reads changed sees this one), says
        why not; that reason, or None when added."""
        with self._lock:
            reason = why_not()
            if reason is None:
                self._by_job[kept.job_id] = kept
            return reason

    def take(self, job_id: str) -> Kept | None:
        """The job's kept tree, now owned by the caller (a restore): nothing else may end it
        meanwhile; None when there is none."""
        with self._lock:
            return self._by_job.pop(job_id, None)

    def get(self, job_id: str) -> Kept | None:
        """The job's kept tree, to look at (it stays here: :meth:`take` to own it)."""
        with self._lock:
            return self._by_job.get(job_id)

    def has(self, job_id: str) -> bool:
        """Whether the job has a kept tree here now."""
        with self._lock:
            return job_id in self._by_job

    def resident(self) -> list[Kept]:
        """The trees whose GPU state stays on their GPU while their job waits, to look at."""
        with self._lock:
            return [k for k in self._by_job.values() if k.resident]

    def jobs_of_image(self, key: str) -> list[str]:
        """The jobs whose kept tree belongs to image ``key``."""
        with self._lock:
            return [k.job_id for k in self._by_job.values() if k.key == key]

    def end(self, job_id: str, reason: str, *, image_key: str | None = None) -> bool:
        """End the job's kept tree (only the one kept for image ``image_key`` when given);
        True when there was one."""
        with self._lock:
            kept = self._by_job.get(job_id)
            if kept is None or (image_key is not None and kept.key != image_key):
                return False
            del self._by_job[job_id]
        self.end_taken(kept, reason)
        return True

    def end_taken(self, kept: Kept, reason: str) -> None:
        """End a tree the caller took (:meth:`take`); its job's status and the log say so."""
        try:
            kept.kill()
        finally:
            self._statuses.unmark_kept(kept.job_id)
            self._event("kept.ended", job_id=kept.job_id, pid=kept.pid, reason=reason)

    def trim_to(self, budget_bytes: int) -> None:
        """End the oldest kept trees until the rest fit ``budget_bytes`` (not those woken
        or restored early for a run about to take them: they go within a minute anyway;
        those kept on their GPU count: they stay as long as any)."""
        with self._lock:
            kept = sorted((k for k in self._by_job.values() if k.early_s() is None or k.resident),
                          key=lambda k: k.since)  # fmt: skip
        sizes = [(k.job_id, k.size_bytes()) for k in kept]
        total = sum(n for _, n in sizes)
        keys = {k.job_id: k.key for k in kept}
        for job_id in over_budget(sizes, budget_bytes):
            self.end(job_id, f"over the keep budget ({total} > {budget_bytes} bytes): its "
                     "next run restores from the image", image_key=keys[job_id])  # fmt: skip


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


class HeldCgroups:
    """Empty parked cgroups held for jobs whose dump left an image, one per job, with the
    device rules of the job's last run: where an early restore puts the tree back."""

    def __init__(self) -> None:
        self._by_job: dict[str, Any] = {}
        self._lock = threading.Lock()

    def hold(self, job_id: str, parking: Any) -> None:
        """Hold ``parking`` (emptied) for the job's image (replacing an older one)."""
        with self._lock:
            old = self._by_job.pop(job_id, None)
            self._by_job[job_id] = parking
        if old is not None:
            old.remove()

    def has(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._by_job

    def take(self, job_id: str) -> Any | None:
        """The job's held cgroup, now the caller's (to use or remove); None when none."""
        with self._lock:
            return self._by_job.pop(job_id, None)

    def drop(self, job_id: str) -> None:
        """Remove the job's held cgroup (its image went, or its job ended for good)."""
        parking = self.take(job_id)
        if parking is not None:
            parking.remove()
