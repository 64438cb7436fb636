"""Daemon start-up after a daemon that died (``kill -9``, OOM, a restart of the service):
what it left parked is ended, its unfinished dumps are failed and deleted, and the pool
uses of the images on disk are taken back."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spswap.checkpoint.cgroups import root_tag, sweep
from spswap.checkpoint.criu import remove_image
from spswap.checkpoint.freeze_hold import sweep_empty_holds
from spswap.checkpoint.service import incomplete_images, job_prefix, removing_dirs, temp_dirs
from spswap.daemon.ckpt_status import resume
from spswap.daemon.image_uses import sync_quietly
from spswap.daemon.statuses import CheckpointState
from spswap.fsutil import read_json
from spswap.liveness import pid_alive

if TYPE_CHECKING:
    from spswap.daemon.state import DaemonState


RECOVER_WAIT_S = 60.0  # how long start-up waits for a dead daemon's CRIU to let go


def on_daemon_start(state: DaemonState) -> dict[str, Any]:
    """Start-up hook (``spswapd`` calls it before serving): clean up after a daemon that
    died mid-dump and take back the pool uses of the checkpoint images on disk."""
    try:
        return recover(state)
    except Exception as e:  # a daemon that cannot clean up must still serve
        state.event("daemon.recover_failed", reason=str(e)[:2000])
        return {"error": str(e)}


def recover(st: DaemonState) -> dict[str, Any]:
    """Daemon start-up: clean up after a daemon that died (``kill -9``, OOM, reboot of
    the service) and take back the pool uses of the images on disk.

    A status left "dumping" is failed with the reason; when its instance still runs (CRIU
    died with the daemon and let the process go) it is told (SIGUSR2) and exits as after
    any failed dump, its requests saved. A CRIU of the dead daemon that still holds the
    process is killed (:func:`end_dead_daemons_criu`), in a thread that then waits for it
    to let go, so the daemon answers meanwhile.
    """
    # first: what a dead daemon left parked outside its job (no home known any more)
    swept = sweep(root_tag(st.cfg.root)) + sweep_empty_holds("")
    if swept:
        st.event("checkpoint.parked_swept", cgroups=swept)
    stale = []
    status_dir = st.statuses.dir
    for path in sorted(status_dir.glob("*.json")) if status_dir.is_dir() else []:
        status = read_json(path) or {}
        if status.get("kept"):  # the sweep above ended what the last daemon kept
            job_id = str(status.get("job_id") or path.stem)
            st.statuses.unmark_kept(job_id)
            st.event("kept.ended", job_id=job_id, pid=status.get("pid"),
                     reason="spswapd started again: the instance the last one kept alive "
                     "was ended; its image brings it back")  # fmt: skip
        if status.get("state") == CheckpointState.DUMPING:
            stale.append((str(status.get("job_id") or path.stem), int(status.get("pid") or 0),
                          status.get("pid_start")))  # fmt: skip
    dumping = {job for job, _, _ in stale}
    removed = []
    images = st.cfg.paths.images
    for p in temp_dirs(images) + incomplete_images(images):
        if not any(_of_job(p, j) for j in dumping):  # those wait for their CRIU to end
            removed.append(remove_image(p))
    for p in removing_dirs(images):  # deletions the dead daemon left undone (at start:
        remove_image(p)  # no newer image of the job has its link names yet)
    for job_id, pid, pid_start in stale:
        threading.Thread(target=_recover_dump, args=(st, job_id, pid, pid_start),
                         daemon=True).start()  # fmt: skip
    sync_quietly(st)
    if stale or removed:
        st.event("checkpoint.recovered", stale_dumps=[j for j, _, _ in stale], removed=removed)
    return {"stale_dumps": [j for j, _, _ in stale], "removed": removed}


def _of_job(p: Path, job_id: str) -> bool:
    return p.name.removeprefix(".tmp-").startswith(job_prefix(job_id))


def _tracer(pid: int, proc: Path = Path("/proc")) -> int:
    """The pid of what traces ``pid`` (a CRIU still dumping it); 0 for none."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _traced(pid: int) -> bool:
    """True while a tracer (a CRIU still dumping) holds ``pid``."""
    return _tracer(pid) != 0


def end_dead_daemons_criu(pid: int, proc: Path = Path("/proc")) -> int | None:
    """SIGKILL the CRIU that still holds ``pid`` for a dead daemon (at start-up no CRIU is
    this daemon's): its image is deleted anyway, and one that hangs would hold the
    process seized for good. Returns the CRIU's pid, None when no CRIU holds it."""
    tracer = _tracer(pid, proc)
    try:
        if tracer <= 0 or (proc / str(tracer) / "comm").read_text().strip() != "criu":
            return None
        os.kill(tracer, signal.SIGKILL)
    except (OSError, ProcessLookupError):
        return None
    return tracer


def _recover_dump(st: DaemonState, job_id: str, pid: int, pid_start: int | None) -> None:
    if pid > 0 and (criu := end_dead_daemons_criu(pid)) is not None:
        st.event("checkpoint.criu_ended", job_id=job_id, criu_pid=criu, pid=pid)
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
    st.statuses.write(job_id, state=CheckpointState.FAILED, pid=pid, reason=reason)
    st.event("checkpoint.failed", job_id=job_id, reason=reason)
    if alive:
        resume(pid, pid_start)
