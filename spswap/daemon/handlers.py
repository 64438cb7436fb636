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
from typing import Any

from spswap import __version__
from spswap.daemon import events
from spswap.daemon.jobs import JobRecord, check_job_id
from spswap.daemon.protocol import PROTOCOL_VERSION
from spswap.daemon.state import ROOT_UID, Context, DaemonState, authorize, require_root
from spswap.errors import DaemonError, PermissionDenied, ProtocolError, SlotError, SpswapError
from spswap.liveness import Holder, pid_alive, pid_start_time
from spswap.slots.table import SlotTable


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
        "nodes": sorted(st.node_names),  # Slurm's names of this host's node(s), from prologs
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


def _peer_holder(ctx: Context, job_id: str | None) -> Holder:
    """The caller as a holder: its pid and uid from SO_PEERCRED, never from the request.

    A job id binds the holder to a Slurm job (it then outlives the process while the job
    runs), so a user may name only a running job the prolog registered for their uid.
    """
    if job_id is not None and ctx.peer_uid != ROOT_UID:
        rec = ctx.state.jobs.get(job_id)
        if rec is None:
            raise PermissionDenied(
                f"job {job_id} is not registered on this node, so it cannot be checked to be "
                f"yours (uid {ctx.peer_uid}); run inside the job (its prolog registers it) "
                "or leave the job id out"
            )
        authorize(ctx.peer_uid, rec.uid, f"job {job_id}")
        from spswap.daemon.missed_prolog import register_missed_run

        rec = register_missed_run(ctx.state, rec)
        if rec.state != "running":
            raise PermissionDenied(f"job {job_id} has {rec.state}; a reservation or pool use "
                                   "can be bound only to a running job")  # fmt: skip
    elif job_id is not None:
        check_job_id(job_id)
    start = pid_start_time(ctx.peer_pid)
    if start is None:
        raise DaemonError(f"the calling process (pid {ctx.peer_pid}) is gone")
    return Holder(pid=ctx.peer_pid, pid_start=start, uid=ctx.peer_uid, job_id=job_id,
                  since=time.time())  # fmt: skip


def _job_gpus_only(ctx: Context, job_id: str | None, asked: list[int] | None) -> list[int] | None:
    """The GPUs a reservation may take: a user's, bound to a job whose prolog recorded its
    GPUs, only those (else a user could queue for every GPU of the node and starve the
    jobs Slurm gave them to); root's, or one with no GPUs recorded, what it asked for."""
    rec = ctx.state.jobs.get(job_id) if job_id is not None else None
    if ctx.peer_uid == ROOT_UID or rec is None or not rec.gpus:
        return asked
    allowed = [g for g in (asked if asked is not None else rec.gpus) if g in rec.gpus]
    if not allowed:
        raise PermissionDenied(f"job {job_id} holds GPUs {rec.gpus}: its reservations may "
                               f"take only those, not {asked}; leave --gpu out or name one "
                               "of them")  # fmt: skip
    return allowed


def op_slots_reserve(ctx: Context, args: dict[str, Any]) -> Any:
    """Reserve for the caller; the wait happens here (this connection's thread only)."""
    holder = _peer_holder(ctx, args.get("job_id"))
    allowed_gpus = _job_gpus_only(ctx, holder.job_id, args.get("allowed_gpus"))
    cached = ctx.state.slot_table()
    table = SlotTable(cached.slots_dir, cached.gpus, job_alive=cached.job_alive,
                      poll_interval_s=cached.poll_interval_s,
                      grant_check=_requester_alive)  # fmt: skip
    res = table.reserve(
        model=args["model"], units=args.get("units", table.UNITS_PER_GPU),
        whole_gpus=args.get("whole_gpus"), allowed_gpus=allowed_gpus,
        holder=holder, timeout_s=float(args["timeout_s"]),
    )  # fmt: skip
    ctx.state.event("slots.reserve", job_id=holder.job_id, uid=holder.uid, pid=holder.pid,
                    reservation=res.id, model=res.model, gpus=list(res.gpus),
                    units=list(res.units))  # fmt: skip
    return res.to_json()


def _requester_alive(holder: Holder) -> None:
    """The table's grant check: stop waiting once the requester has gone (its client was
    killed mid-wait): otherwise its queue ticket would hold back everyone behind it until
    the timeout."""
    if not pid_alive(holder.pid, holder.pid_start):
        raise SlotError(f"pid {holder.pid} asked for a slot and exited while waiting")


def _pool(ctx: Context) -> Any:
    from spswap.pool.store import Pool

    return Pool.from_config(ctx.state.cfg, job_alive=ctx.state.job_probe())


def op_pool_use(ctx: Context, args: dict[str, Any]) -> Any:
    """Mark a pool entry used by the caller (never evicted while it lives)."""
    holder = _peer_holder(ctx, args.get("job_id"))
    manifest = _pool(ctx).acquire_use(args["ref"], holder)
    return manifest.to_json()


def op_pool_unuse(ctx: Context, args: dict[str, Any]) -> Any:
    """Drop one of the caller's uses of an entry (other holders' uses are untouchable)."""
    pool = _pool(ctx)
    manifest = pool.find(args["ref"])
    rec = pool.index.read_unlocked().entries.get(manifest.digest)
    for h in rec.uses if rec else []:
        if h.pid == ctx.peer_pid and h.uid == ctx.peer_uid:
            pool.release_use(manifest.digest, h)
            return {"digest": manifest.digest, "released": True}
    return {"digest": manifest.digest, "released": False}


def op_pool_import(ctx: Context, args: dict[str, Any]) -> Any:
    """Import from the descriptors the caller opened: only what the caller can read."""
    from spswap.pool.importer import import_from_fds

    names = args["files"]
    if len(names) != len(ctx.fds):
        raise ProtocolError(f"pool.import names {len(names)} file(s) but {len(ctx.fds)} "
                            "descriptor(s) came with it; send one descriptor per name")  # fmt: skip
    files = list(zip(names, ctx.fds, strict=True))
    identity = args.get("identity")
    if identity is not None:
        if not isinstance(identity, dict):
            raise ProtocolError("pool.import identity must be a JSON object")
        # who exported it, from SO_PEERCRED: engines trust only their own user's (and
        # root's) exports, so no user can plant weights under another's identity
        identity = {**identity, "owner_uid": ctx.peer_uid}
    pool = _pool(ctx)
    manifest = import_from_fds(pool, files, name=args.get("name"), owner_uid=ctx.peer_uid,
                               identity=identity)  # fmt: skip
    if identity is not None:
        # the caller's bytes are this entry's (same digest), whoever exported them first:
        # the caller finds it under its own uid from now on
        from spswap.pool.store import alias_key

        pool.remember_alias(alias_key(identity, ctx.peer_uid), manifest.digest)
    ctx.state.event("pool.import", uid=ctx.peer_uid, pid=ctx.peer_pid, name=manifest.name,
                    digest=manifest.digest)  # fmt: skip
    return manifest.to_json()


def op_job_register(ctx: Context, args: dict[str, Any]) -> Any:
    require_root(ctx.peer_uid, "job.register")
    st = ctx.state
    with st.lock:
        if args.get("node"):
            st.node_names.add(str(args["node"]))
        st.jobs.prune()
        rec = JobRecord(
            job_id=args["job_id"], uid=args["uid"], user=args.get("user", ""),
            gpus=list(args.get("gpus", [])), restart_count=args.get("restart_count", 0),
            registered_at=time.time(),
        )  # fmt: skip
        st.jobs.put(rec)
    st.event("job.start", job_id=rec.job_id, uid=rec.uid, user=rec.user, gpus=rec.gpus,
             restart_count=rec.restart_count)  # fmt: skip
    # Off the prolog's path: the epilog cannot tell a requeued job from a finished one
    # (both COMPLETING), so each prolog looks again at the jobs that left images behind.
    threading.Thread(target=collect_images, args=(st, rec.job_id), daemon=True).start()
    return rec.to_json()


def collect_images(st: DaemonState, current_job: str) -> list[str]:
    """Delete the images (and kept trees) of jobs that will not be restored here, never
    the current job's: Slurm says they are gone, or they run on another node now (this
    node's image would roll back what the job does there, and a kept tree holds memory).
    Returns the job ids whose images went."""
    from spswap.checkpoint.service import image_job_ids
    from spswap.daemon.image_uses import drop_job_images

    gone = []
    for job_id in image_job_ids(st.cfg.paths.images, st.statuses.dir):
        if job_id == current_job:
            continue
        reason = _not_coming_back(st, job_id)
        if reason:
            drop_job_images(st, job_id, reason)
            st.event("images.collected", job_id=job_id, reason=reason)
            gone.append(job_id)
    return gone


def _not_coming_back(st: DaemonState, job_id: str) -> str | None:
    """Why the job's images here will not be restored, or None (back, or not known)."""
    info, answered = st.ask_slurm(job_id)
    if info is None:
        # the controller answered but no longer knows it: finished, past MinJobAge
        return "Slurm no longer knows the job" if answered else None
    from spswap.daemon.image_uses import job_fate

    if job_fate(info.state, None) == "gone":
        return f"the job ended ({info.state})"
    if info.runs_elsewhere(st.node_names):
        return f"the job runs on {info.nodes} now, not on {', '.join(sorted(st.node_names))}"
    return None


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
    """The epilog: give back the job's slots and pool uses; keep the pool. The job's
    checkpoint images stay only if it comes back (requeued): Slurm says so, or, where
    Slurm does not know the job, the ``requeued`` argument; when neither can tell they
    stay (an unused image costs tmpfs, a deleted one a cold start)."""
    require_root(ctx.peer_uid, "job.end")
    st = ctx.state
    job_id = args["job_id"]
    requeued = args.get("requeued")
    problems = []
    released: list[str] = []
    dropped: list[str] = []
    images_deleted: list[str] = []
    try:
        released = _release_job_reservations(st, job_id)
    except Exception as e:  # the rest of the epilog still runs
        problems.append(f"slots: {e}")
    try:
        dropped = _drop_job_pool_uses(st, job_id)
    except Exception as e:
        problems.append(f"pool: {e}")
    fate = "unknown"
    try:
        fate = _job_fate(st, job_id, requeued)
        if fate == "gone":
            from spswap.daemon.image_uses import drop_job_images

            images_deleted = drop_job_images(st, job_id)
    except Exception as e:
        problems.append(f"images: {e}")
    with st.lock:
        rec = st.jobs.get(job_id) or JobRecord(job_id=job_id, uid=-1)
        rec.state = "requeued" if requeued or fate == "back" else "ended"
        rec.ended_at = time.time()
        st.jobs.put(rec)
    result = {"job_id": job_id, "state": rec.state, "released_reservations": released,
              "dropped_pool_uses": dropped, "fate": fate, "images_deleted": images_deleted,
              "problems": problems}  # fmt: skip
    st.event(
        "job.end", job_id=job_id, uid=rec.uid, state=rec.state, fate=fate,
        released_reservations=released, dropped_pool_uses=dropped,
        images_deleted=images_deleted, problems=problems,
    )  # fmt: skip
    return result


def _job_fate(st: DaemonState, job_id: str, requeued: bool | None) -> str:
    """"back", "gone" or "unknown"; asks Slurm only when the job has images to decide on."""
    from spswap.checkpoint.service import images_of_job, temp_dirs
    from spswap.daemon.image_uses import job_fate

    if not images_of_job(st.cfg.paths.images, job_id) and not temp_dirs(st.cfg.paths.images,
                                                                          job_id):
        return job_fate(None, requeued)
    info, _ = st.ask_slurm(job_id)
    return job_fate(info.state if info is not None else None, requeued)


def on_daemon_start(state: DaemonState) -> dict[str, Any]:
    """Start-up hook (``spswapd`` calls it before serving): clean up after a daemon that
    died mid-dump and take back the pool uses of the checkpoint images on disk."""
    from spswap.daemon.ckpt_recover import recover

    try:
        return recover(state)
    except Exception as e:  # a daemon that cannot clean up must still serve
        state.event("daemon.recover_failed", reason=str(e)[:2000])
        return {"error": str(e)}


def op_jobs_list(ctx: Context, args: dict[str, Any]) -> Any:
    """Root sees every job; a user only their own."""
    return [j.to_json() for j in ctx.state.jobs.all()
            if ctx.peer_uid == ROOT_UID or j.uid == ctx.peer_uid]  # fmt: skip


def op_events_tail(ctx: Context, args: dict[str, Any]) -> Any:
    """Root sees every event; a user only those about their own jobs and processes."""
    tail = events.tail(ctx.state.cfg.paths.events, args.get("n", 50))
    if ctx.peer_uid == ROOT_UID:
        return tail
    return [e for e in tail if e.get("uid") == ctx.peer_uid]
