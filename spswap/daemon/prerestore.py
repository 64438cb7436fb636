"""A job's image restored early, at its prolog, into a kept tree (the image path's part of
the early wake, :mod:`spswap.daemon.prewake`).

A requeued run that comes back from its image spends about half a second starting (Slurm's
start, Python, the CLI) before it asks spswapd to restore, and then waits for CRIU's
restore (1.8-2.0 s on the H200, 0.5B-3B vLLM servers) and the CUDA restore. Where the dump
left its tree's parked cgroup with the device rules of the job's last run in it (exactly
the GPUs the tree held; the dump's ``_LeaveJob.close`` hands it to
:class:`~spswap.daemon.kept.HeldCgroups`), spswapd restores the image at the job's prolog
instead: CRIU starts inside that cgroup (so the restored tree never runs under other
device rules) and the tree is frozen as soon as CRIU is done. The image stays (no
``--auto-dedup``) until the run takes the tree, which is then a kept tree as any other:
the early wake restores its GPU state where it may, the run's restore only joins and
unlocks it, and the run's record says it came from its image.

Checked first, as a restore would: the image's integrity and owner, its identity against
the job's owner, its processes' credentials, and memory for the tree beside its image (the
run's own identity, which the prolog does not know, is checked when the run takes the
tree, as for a kept one). The memory is claimed while CRIU restores
(:mod:`spswap.daemon.memory_claims`), so that prologs at once do not count it twice. A
tree its run does not take is ended after :data:`spswap.daemon.prewake.HOLD_S` and at the
job's end; the image stays.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spswap.checkpoint import criu
from spswap.checkpoint.credentials import user_groups
from spswap.checkpoint.criu_user import RunAs
from spswap.checkpoint.image_creds import image_problem
from spswap.checkpoint.images import Identity, node_identity, read_meta, verify_before_restore
from spswap.checkpoint.service import images_of_job
from spswap.daemon.image_uses import sync_quietly
from spswap.daemon.kept import Kept
from spswap.daemon.statuses import CheckpointState
from spswap.errors import CriuNotStarted
from spswap.fsutil import dir_size_bytes, read_json
from spswap.liveness import pid_start_time

if TYPE_CHECKING:
    from spswap.daemon.state import DaemonState


def restore_early(st: DaemonState, job_id: str) -> Kept | None:
    """The job's image restored into its held cgroup and frozen: a kept tree for its next
    run, owned by the caller (who holds the job lock); None where it is not done (the
    reason, if any, in the event log). Never raises. The image stays, unless CRIU's restore
    of it failed (as after a run's failed restore: deleted, the run starts cold)."""
    parking = st.held_cgroups.take(job_id)
    rec = st.jobs.get(job_id)
    if parking is None or rec is None:
        if parking is not None:
            parking.remove()
        return None
    try:
        t0 = time.monotonic()
        image, why = _image_to_restore(st, job_id, rec.uid)
        verify_s = time.monotonic() - t0
        if image is None:
            parking.remove()
            if why:  # (nothing to say where there is no image to restore)
                st.event_quietly("restore.not_restored_early", job_id=job_id, reason=why)
            return None
        with st.memory_claims.claim(dir_size_bytes(image)) as short:
            if short is not None:
                parking.remove()
                st.event_quietly("restore.not_restored_early", job_id=job_id, reason=short)
                return None
            kept = _restore_into(st, job_id, rec.uid, image, parking, verify_s)
        # the job may have ended meanwhile (its images collected without this tree)
        if st.statuses.read(job_id).get("state") != CheckpointState.SAVED or not image.is_dir():
            raise RuntimeError("its job's image went while it was restored early")
    except Exception as e:  # noqa: BLE001 - never into the prolog's daemon thread
        parking.kill_all()
        parking.remove()
        st.event_quietly("restore.not_restored_early", job_id=job_id, reason=str(e)[:2000])
        return None
    st.event_quietly("restore.restored_early", job_id=job_id, pid=kept.pid,
          timings_s=kept.restore_timings)  # fmt: skip
    return kept


def _image_to_restore(st: DaemonState, job_id: str, uid: int) -> tuple[Path | None, str]:
    """The job's image when it may be restored early for the job's owner ``uid``, else
    (None, why not)."""
    images = images_of_job(st.cfg.paths.images, job_id)
    if st.statuses.read(job_id).get("state") != CheckpointState.SAVED or not images:
        return None, ""
    image = images[-1]
    short = st.memory_claims.short(dir_size_bytes(image))  # first: the check may read it all
    if short is not None:
        return None, short
    if any(r.get("parked") is None for r in
           (read_json(image / criu.DUMP_META) or {}).get("link_remaps", [])):  # fmt: skip
        # CRIU's restore would use up the one link the image has: for the run's restore only
        return None, "a file the image needs is not set aside (its link under CRIU's name)"
    # this node's parts and the job owner's uid, as a restore checks them (the model's,
    # which the prolog does not know, are checked when the run takes the tree)
    recorded = {**(read_meta(image) or {}).get("identity", {}), **node_identity(), "uid": uid}
    try:
        expected = Identity(**recorded)
    except TypeError:
        return None, "its meta.json has no complete identity"
    why = verify_before_restore(image, expected, read_content=st.cfg.image_check == "full")
    if why is None and (problem := image_problem(image, uid, user_groups(uid))):
        why = f"its processes' credentials are not the job user's: {problem}"
    return (None, why) if why is not None else (image, "")


def _restore_into(st: DaemonState, job_id: str, uid: int, image: Path, parking: Any,
                  verify_s: float) -> Kept:  # fmt: skip
    run_as = RunAs.for_uid(uid) if not st.cfg.criu_as_root and uid != 0 else None
    dumped = set(image.rglob("*"))
    t0 = time.monotonic()
    try:
        pid = criu.restore(image.name, st.cfg.paths.images, run_as=run_as,
                           cgroup_dirs=list(parking.dirs.values()),
                           hugepages=st.cfg.restore_hugepages)  # fmt: skip
    except CriuNotStarted:
        raise  # the image was not touched: the run restores it itself
    except Exception as e:
        # as a run's failed restore: the image is not tried again (CRIU's restore dropped
        # the links it put in place for it); the run starts cold and says why
        reason = f"{e}\nthe image {image.name} was deleted: cold start"
        criu.remove_image(image, tree_gone=True)
        st.statuses.write(job_id, state=CheckpointState.FAILED, reason=reason)
        st.event_quietly("restore.failed", job_id=job_id, uid=uid, reason=reason[:2000], early=True)
        sync_quietly(st)
        raise
    finally:
        criu_s = time.monotonic() - t0
        frozen = parking.freeze()  # first: the tree runs no code outside a job meanwhile
        # what CRIU's restore wrote into the image (its stats, a pid file) goes: the image
        # stays as dumped, for the run's check and as the way back
        for path in set(image.rglob("*")) - dumped:
            if path.is_file():
                path.unlink(missing_ok=True)
    if not frozen:
        raise RuntimeError("the restored tree could not be frozen where it waits")
    now = time.time()
    timings = {"verify": verify_s, "criu_restore": criu_s}
    return Kept(job_id, pid, pid_start_time(pid), parking, image.name, now,
                restored_early_s=now, restore_timings=timings)  # fmt: skip
