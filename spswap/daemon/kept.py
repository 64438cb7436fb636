"""Kept instances: dumped trees left alive and frozen beside their images, so the job's
next run skips CRIU's restore; kept within the node's keep budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spswap.daemon.ckpt_status import set_status, status_path
from spswap.fsutil import read_json
from spswap.liveness import pid_alive

if TYPE_CHECKING:
    from spswap.daemon.state import DaemonState


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


def record(st: DaemonState, kept: Kept) -> None:
    """A tree kept after its job's dump (replacing none: the dump ended the job's last)."""
    with st.kept_lock:
        st.kept[kept.job_id] = kept


def take(st: DaemonState, job_id: str) -> Kept | None:
    """The job's kept tree, now owned by the caller (a restore): nothing else may end it
    meanwhile; None when there is none."""
    with st.kept_lock:
        return st.kept.pop(job_id, None)


def jobs_kept_for(st: DaemonState, key: str) -> list[str]:
    """The jobs whose kept tree belongs to image ``key``."""
    with st.kept_lock:
        return [k.job_id for k in st.kept.values() if k.key == key]


def end_kept(st: DaemonState, job_id: str, reason: str, *, key: str | None = None) -> bool:
    """End the job's kept instance (only the one kept for image ``key`` when given);
    True when there was one."""
    with st.kept_lock:
        kept = st.kept.get(job_id)
        if kept is None or (key is not None and kept.key != key):
            return False
        del st.kept[job_id]
    finish_kept(st, kept, reason)
    return True


def finish_kept(st: DaemonState, kept: Kept, reason: str) -> None:
    """End a kept tree no longer recorded (:func:`take`); its job's status and the log say so."""
    try:
        kept.end()
    finally:
        not_kept_any_more(st, kept.job_id)
        st.event("kept.ended", job_id=kept.job_id, pid=kept.pid, reason=reason)


def not_kept_any_more(st: DaemonState, job_id: str) -> None:
    """A saved job's status no longer says kept (``spswap status``): its image remains."""
    status = read_json(status_path(st, job_id)) or {}
    if status.get("state") == "saved" and status.get("kept"):
        rest = {k: v for k, v in status.items() if k not in ("job_id", "kept")}
        set_status(st, job_id, **rest, kept=False)


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


def keep_within_budget(st: DaemonState) -> None:
    """End the oldest kept instances until the rest fit ``keep_bytes``."""
    budget = st.cfg.keep_budget_bytes()
    with st.kept_lock:
        kept = sorted(st.kept.values(), key=lambda k: k.since)
    sizes = [(k.job_id, k.size_bytes()) for k in kept]
    total = sum(n for _, n in sizes)
    keys = {k.job_id: k.key for k in kept}
    for job_id in over_budget(sizes, budget):
        end_kept(st, job_id, f"over the keep budget ({total} > {budget} bytes): its next "
                  "run restores from the image", key=keys[job_id])  # fmt: skip
