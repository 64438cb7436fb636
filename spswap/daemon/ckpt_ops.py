"""The daemon's checkpoint, restore and checkpoint.status ops.

Flow, for one job's instance P and, after the requeue, the new run's proxy Q:

- P (asleep, slot released) asks ``checkpoint``. The daemon answers at once and dumps P in
  a thread once P has closed the connection (a connected socket cannot be dumped). On
  success P is gone and its image is on tmpfs; on failure P runs on and gets SIGUSR2.
- Q (new run, restart count > 0, slot reserved) asks ``restore``. The daemon checks the
  image's identity and integrity, restores P (CUDA restore and unlock included), records
  the new run for P and sends P SIGUSR2; P asks ``checkpoint.status`` and carries on.
- A rejected image (other identity, changed bytes) is deleted and Q cold-starts; the
  reason goes to the event log, the answer and ``spswap status``.

The identity parts the caller cannot be trusted with (uid, driver, GPU model, CRIU) are
taken by the daemon itself; the caller names its engine, versions, model and config.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spswap.checkpoint.images import Identity
from spswap.errors import CheckpointFailed, DaemonError
from spswap.fsutil import atomic_write_json, read_json

if TYPE_CHECKING:  # handlers imports this module to register the ops
    from spswap.daemon.handlers import Context, DaemonState


def _job_for(ctx: Context, job_id: str) -> Any:
    from spswap.daemon.handlers import _job_for as job_for

    return job_for(ctx, job_id)

IDENTITY_ARGS = ("engine", "engine_version", "torch", "python", "model_digest", "config_hash")
RESUME_SIGNAL = signal.SIGUSR2


@functools.lru_cache(maxsize=1)
def node_identity() -> dict[str, str]:
    """Driver version, GPU model and CRIU version of this node (read once: no NVML, which
    costs seconds without persistence mode)."""
    from spswap.checkpoint import criu
    from spswap.doctor import parse_nvidia_version

    try:
        driver = parse_nvidia_version(Path("/proc/driver/nvidia/version").read_text()) or "none"
    except OSError:
        driver = "none"
    gpu_model = "none"
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                gpu_model = line.split(":", 1)[1].strip()
                break
        break
    path = criu.find_criu()
    version = ".".join(map(str, criu.criu_version(path))) if path else "none"
    return {"driver": driver, "gpu_model": gpu_model, "criu_version": version}


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
    pid = int(args.get("pid") or ctx.peer_pid)
    if ctx.peer_uid != 0 and pid != ctx.peer_pid:
        raise DaemonError("a user may checkpoint only the calling process itself")
    identity = _identity(args, rec.uid)
    from spswap.checkpoint.criu import find_criu

    if find_criu() is None:
        raise CheckpointFailed("no CRIU on this node: run scripts/build_criu.sh (see doctor)")
    _set_status(st, job_id, state="dumping", pid=pid)
    st.event("checkpoint.start", job_id=job_id, uid=rec.uid, pid=pid)
    requeue = bool(args.get("requeue"))
    threading.Thread(target=_dump, args=(st, job_id, pid, identity, requeue),
                     daemon=True).start()  # fmt: skip
    return {"accepted": True, "pid": pid}


def _dump(st: DaemonState, job_id: str, pid: int, identity: Identity, requeue: bool) -> None:
    from spswap.checkpoint.service import dump_instance

    try:
        report = dump_instance(st.cfg.paths.images, job_id=job_id, pid=pid, identity=identity)
    except Exception as e:  # the instance runs on: tell it, and record why
        _set_status(st, job_id, state="failed", pid=pid, reason=str(e))
        st.event("checkpoint.failed", job_id=job_id, uid=identity.uid, reason=str(e)[:2000])
        try:
            os.kill(pid, RESUME_SIGNAL)
        except ProcessLookupError:
            pass
        return
    _set_status(st, job_id, state="saved", pid=pid, key=report.key,
                size_bytes=report.size_bytes, timings_s=report.timings_s)  # fmt: skip
    st.event("checkpoint.saved", job_id=job_id, uid=identity.uid, image=report.to_json())
    if requeue:
        _requeue(st, job_id)


def _requeue(st: DaemonState, job_id: str) -> None:
    """Requeue after the image is complete (as the instance asked): the image is worth
    nothing if the job does not come back."""
    from spswap.slurm.backend import get_backend

    try:
        backend = get_backend()
        if backend is not None:
            backend.requeue(job_id)
            st.event("job.requeue", job_id=job_id)
    except Exception as e:  # preemption may have requeued it already
        st.event("job.requeue_refused", job_id=job_id, reason=str(e)[:500])


def op_restore(ctx: Context, args: dict[str, Any]) -> Any:
    """Restore the job's instance for the caller (the new run's proxy)."""
    st = ctx.state
    job_id = args["job_id"]
    rec = _job_for(ctx, job_id)
    expected = _identity(args, rec.uid)
    status = read_json(_status_path(st, job_id)) or {}
    if status.get("state") != "saved":
        raise CheckpointFailed(
            f"job {job_id} has no saved image (state {status.get('state', 'none')}): cold start"
        )
    from spswap.checkpoint.service import ImageRejected, restore_instance

    try:
        pid, timings = restore_instance(st.cfg.paths.images, job_id=job_id, expected=expected)
    except ImageRejected as e:
        _set_status(st, job_id, state="rejected", reason=str(e))
        st.event("restore.rejected", job_id=job_id, uid=rec.uid, reason=str(e))
        raise
    except CheckpointFailed as e:
        _set_status(st, job_id, state="failed", reason=str(e))
        st.event("restore.failed", job_id=job_id, uid=rec.uid, reason=str(e)[:2000])
        raise
    _set_status(st, job_id, state="restored", pid=pid, proxy_pid=ctx.peer_pid,
                restart_count=int(args.get("restart_count", 0)), timings_s=timings)  # fmt: skip
    st.event("restore.done", job_id=job_id, uid=rec.uid, pid=pid, timings_s=timings)
    os.kill(pid, RESUME_SIGNAL)
    return {"pid": pid, "timings_s": timings}


def op_checkpoint_status(ctx: Context, args: dict[str, Any]) -> Any:
    """Where the job's checkpoint stands: dumping, saved, failed, rejected or restored."""
    job_id = args["job_id"]
    _job_for(ctx, job_id)
    return read_json(_status_path(ctx.state, job_id)) or {"job_id": job_id, "state": "none"}
