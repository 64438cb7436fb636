"""Image lifecycle: while an image exists its pool entry must stay (the restored process
maps the entry's file by path; a multi-model job's image needs each of its models'
entries: :func:`~spswap.checkpoint.images.pool_digests`), so the daemon holds one pool
use per image on disk and entry
(holder: the daemon process itself, no job; see :func:`sync_image_uses`), and one per dump
in progress. The uses are re-counted after every dump, restore and job end and at
start-up, so a daemon killed with ``-9`` (its uses die with it) takes them back when it
starts again. Also: dropping a job's images when it will not return
(:func:`drop_job_images`)."""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import TYPE_CHECKING

from spswap.checkpoint.criu import remove_image
from spswap.checkpoint.images import pool_digests
from spswap.checkpoint.service import delete_job_images, image_digests, job_of_key
from spswap.errors import PoolEntryNotFound
from spswap.liveness import Holder, pid_start_time
from spswap.pool.store import Pool

if TYPE_CHECKING:
    from spswap.daemon.state import DaemonState
    from spswap.liveness import Holder


def _daemon_holder(job: str | None = None) -> Holder:
    pid = os.getpid()
    return Holder(pid=pid, pid_start=pid_start_time(pid), uid=os.getuid(), job_id=None,
                  since=time.time(), purpose="image", for_job=job)  # fmt: skip


def sync_image_uses(st: DaemonState) -> dict[str, int]:
    """Hold exactly one pool use per image on disk (holder: this daemon process).

    An image whose pool entry is gone can never be restored (the process it holds maps
    the entry's file): it is deleted. Returns digest -> uses now held.
    """
    if not st.cfg.paths.pool.is_dir():
        return {}
    me = _daemon_holder()
    with st.dumping.lock:
        pool = Pool.from_config(st.cfg, job_alive=st.job_probe())
        by_digest = image_digests(st.cfg.paths.images)
        # (digest, job): each use says whose image it holds the entry for
        want = Counter((d, job_of_key(key)) for key, needed in by_digest.items()
                       for d in pool_digests(needed))  # fmt: skip
        # dumps in progress in this daemon: an early-requeued job's epilog drops the job's
        # own use while CRIU still reads the process that maps the entry
        want.update((d, job) for job, d in st.dumping.digests())
        have = Counter((e.manifest.digest, h.for_job) for e in pool.entries()
                       for h in e.users if _same_holder(h, me))  # fmt: skip
        for digest, job in set(want) | set(have):
            holder = _daemon_holder(job)
            for _ in range(want[digest, job] - have[digest, job]):
                try:
                    pool.acquire_use(digest, holder)
                except PoolEntryNotFound:
                    _drop_images_needing(st, by_digest, digest)
                    for key in [k for k in want if k[0] == digest]:
                        want[key] = 0
                    break
            for _ in range(have[digest, job] - want[digest, job]):
                pool.release_use(digest, holder)
        out: Counter[str] = Counter()
        for (digest, _job), n in want.items():
            out[digest] += n
        return {d: n for d, n in out.items() if n}


def _same_holder(a: Holder, b: Holder) -> bool:
    """Both are this daemon's image uses (whatever job each is for)."""
    return (a.pid, a.pid_start, a.uid, a.job_id, a.purpose) == \
        (b.pid, b.pid_start, b.uid, b.job_id, b.purpose)  # fmt: skip


def _drop_images_needing(st: DaemonState, by_digest: dict[str, str], digest: str) -> None:
    for key, needed in by_digest.items():
        if digest in pool_digests(needed):
            for job_id in st.kept.jobs_of_image(key):
                st.kept.end(job_id, "its image was dropped", image_key=key)
            # (names kept: a restore of the job may hold the tree now, out of st.kept)
            remove_image(st.cfg.paths.images / key)
            st.event(
                "image.dropped",
                image=key,
                reason=f"its pool entry {digest[:12]} is gone: it cannot be restored",
            )


def sync_quietly(st: DaemonState) -> None:
    """A failed re-count must not fail the dump or restore it follows."""
    try:
        sync_image_uses(st)
    except Exception as e:  # noqa: BLE001 - logged; the next sync tries again
        st.event("image.uses_failed", reason=str(e)[:500])


def drop_job_images(st: DaemonState, job_id: str,
                    reason: str = "the job ended and will not return") -> list[str]:  # fmt: skip
    """Delete the job's images and unfinished dumps (ending its kept tree) and give back
    their pool uses; ``reason`` goes to the events and the checkpoint status (a restored
    instance's status says deleted too: its image went at the restore)."""
    st.kept.end(job_id, reason)
    st.held_cgroups.drop(job_id)
    gone = delete_job_images(st.cfg.paths.images, job_id, tree_gone=True)
    st.statuses.mark_gone(job_id, reason, images_deleted=bool(gone))
    sync_quietly(st)
    return gone
