"""What the daemon does for each op, and who may ask for it.

Every handler takes the request's :class:`Context` (the caller's uid and pid from
``SO_PEERCRED``, and the daemon's state) and its validated args, and returns a
JSON-ready result or raises a :class:`~spswap.errors.SpswapError`. Authorization is
per request: root may act on everything; a user only on their own jobs, reservations
and images.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spswap import __version__
from spswap.config import Config
from spswap.daemon import events
from spswap.daemon.jobs import JobRecord, JobStore
from spswap.daemon.protocol import PROTOCOL_VERSION
from spswap.errors import DaemonError, PermissionDenied, SpswapError
from spswap.liveness import JobProbe

ROOT_UID = 0


def authorize(peer_uid: int, owner_uid: int, what: str) -> None:
    """Root may act on anything; anyone else only on what ``owner_uid`` owns."""
    if peer_uid != ROOT_UID and peer_uid != owner_uid:
        raise PermissionDenied(
            f"{what} belongs to uid {owner_uid}, not to you (uid {peer_uid}); ask its owner or root"
        )


def require_root(peer_uid: int, op: str) -> None:
    if peer_uid != ROOT_UID:
        raise PermissionDenied(
            f"{op} is for the Slurm prolog/epilog (root) only; you are uid {peer_uid}"
        )


@dataclass
class DaemonState:
    """What the daemon keeps between requests: only caches; the truth is on tmpfs."""

    cfg: Config
    started_at: float = field(default_factory=time.time)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _slot_table: Any = None
    _job_probe: JobProbe | None = None
    _probe_loaded: bool = False

    @property
    def jobs(self) -> JobStore:
        return JobStore(self.cfg.paths.run / "jobs")

    def event(self, kind: str, **fields: Any) -> None:
        events.append(self.cfg.paths.events, kind, **fields)

    def job_probe(self) -> JobProbe | None:
        """Slurm's answer to "is this job alive", when a backend is available."""
        if not self._probe_loaded:
            self._probe_loaded = True
            from spswap.slurm.backend import job_probe

            self._job_probe = job_probe()
        return self._job_probe

    def slot_table(self) -> Any:
        # GPU discovery may touch NVML (slow without persistence mode): do it once
        if self._slot_table is None:
            from spswap.slots.table import SlotTable

            self._slot_table = SlotTable.from_config(self.cfg, job_alive=self.job_probe())
        return self._slot_table


@dataclass(frozen=True)
class Context:
    """One request's caller and the daemon it reached."""

    peer_uid: int
    peer_pid: int
    state: DaemonState


Handler = Callable[[Context, dict[str, Any]], Any]


def op_ping(ctx: Context, args: dict[str, Any]) -> Any:
    return {"pong": True, "pid": os.getpid(), "protocol": PROTOCOL_VERSION}


def op_status(ctx: Context, args: dict[str, Any]) -> Any:
    st = ctx.state
    return {
        "pid": os.getpid(),
        "version": __version__,
        "protocol": PROTOCOL_VERSION,
        "root": str(st.cfg.root),
        "socket": str(st.cfg.paths.socket),
        "started_at": st.started_at,
        "uptime_s": round(time.time() - st.started_at, 3),
        "jobs": sum(1 for j in st.jobs.all() if j.state == "running"),
    }


def op_slots_list(ctx: Context, args: dict[str, Any]) -> Any:
    return ctx.state.slot_table().snapshot()


def op_slots_release(ctx: Context, args: dict[str, Any]) -> Any:
    table = ctx.state.slot_table()
    rid = args["reservation_id"]
    for r in table.reservations():
        if r.id == rid:
            authorize(ctx.peer_uid, r.holder.uid, f"reservation {rid}")
    released = table.release(rid, uid=ctx.peer_uid)
    ctx.state.event("slots.release", job_id=released.holder.job_id, uid=ctx.peer_uid,
                    reservation=released.id, model=released.model)  # fmt: skip
    return released.to_json()


def op_job_register(ctx: Context, args: dict[str, Any]) -> Any:
    require_root(ctx.peer_uid, "job.register")
    st = ctx.state
    with st.lock:
        st.jobs.prune()
        rec = JobRecord(
            job_id=args["job_id"], uid=args["uid"], user=args.get("user", ""),
            gpus=list(args.get("gpus", [])), restart_count=args.get("restart_count", 0),
            registered_at=time.time(),
        )  # fmt: skip
        st.jobs.put(rec)
    st.event("job.start", job_id=rec.job_id, uid=rec.uid, user=rec.user, gpus=rec.gpus,
             restart_count=rec.restart_count)  # fmt: skip
    return rec.to_json()


def _release_job_reservations(st: DaemonState, job_id: str) -> list[str]:
    table = st.slot_table()
    released = []
    for r in table.reservations():
        if r.holder.job_id == job_id:
            try:
                table.release(r.id)
                released.append(r.id)
            except SpswapError:
                pass  # reclaimed meanwhile
    return released


def _drop_job_pool_uses(st: DaemonState, job_id: str) -> list[str]:
    if not st.cfg.paths.pool.is_dir():
        return []
    from spswap.pool.store import Pool

    pool = Pool.from_config(st.cfg, job_alive=st.job_probe())
    dropped = []
    for entry in pool.entries():
        for holder in entry.users:
            if holder.job_id == job_id:
                pool.release_use(entry.manifest.digest, holder)
                dropped.append(entry.manifest.digest)
    return dropped


def op_job_end(ctx: Context, args: dict[str, Any]) -> Any:
    """The epilog: give back the job's slots and pool uses; keep the pool and images."""
    require_root(ctx.peer_uid, "job.end")
    st = ctx.state
    job_id = args["job_id"]
    requeued = args.get("requeued")
    problems = []
    released: list[str] = []
    dropped: list[str] = []
    try:
        released = _release_job_reservations(st, job_id)
    except Exception as e:  # the rest of the epilog still runs
        problems.append(f"slots: {e}")
    try:
        dropped = _drop_job_pool_uses(st, job_id)
    except Exception as e:
        problems.append(f"pool: {e}")
    with st.lock:
        rec = st.jobs.get(job_id) or JobRecord(job_id=job_id, uid=-1)
        rec.state = "requeued" if requeued else "ended"
        rec.ended_at = time.time()
        st.jobs.put(rec)
    result = {"job_id": job_id, "state": rec.state, "released_reservations": released,
              "dropped_pool_uses": dropped, "problems": problems}  # fmt: skip
    st.event(
        "job.end", job_id=job_id, uid=rec.uid, state=rec.state,
        released_reservations=released, dropped_pool_uses=dropped, problems=problems,
    )  # fmt: skip
    return result


def op_jobs_list(ctx: Context, args: dict[str, Any]) -> Any:
    return [j.to_json() for j in ctx.state.jobs.all()]


def op_events_tail(ctx: Context, args: dict[str, Any]) -> Any:
    return events.tail(ctx.state.cfg.paths.events, args.get("n", 50))


def _job_for(ctx: Context, job_id: str) -> JobRecord:
    rec = ctx.state.jobs.get(job_id)
    if rec is None:
        raise DaemonError(
            f"job {job_id} is not registered on this node (its prolog did not run here); "
            "see `spswap status`"
        )
    authorize(ctx.peer_uid, rec.uid, f"job {job_id}")
    return rec


def _not_yet(op: str) -> Any:
    def handler(ctx: Context, args: dict[str, Any]) -> Any:
        _job_for(ctx, args["job_id"])
        raise DaemonError(f"{op} is not available yet: it arrives with the checkpoint issue")

    return handler


HANDLERS: dict[str, Handler] = {
    "ping": op_ping,
    "status": op_status,
    "slots.list": op_slots_list,
    "slots.release": op_slots_release,
    "job.register": op_job_register,
    "job.end": op_job_end,
    "jobs.list": op_jobs_list,
    "events.tail": op_events_tail,
    "checkpoint": _not_yet("checkpoint"),
    "restore": _not_yet("restore"),
}
