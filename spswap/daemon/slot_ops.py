"""The slot ops: ``slots.list``, ``slots.reserve`` (the caller waits in line on its own
connection's thread) and ``slots.release`` (only the holder's own, or root), and the
giving way of users' reservations outside a job to a job that starts on their GPU."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from spswap.daemon import on_gpu
from spswap.daemon.caller import job_gpus_only, jobless_barred, peer_holder
from spswap.daemon.jobs import JobRecord
from spswap.daemon.protocol import Answer
from spswap.daemon.state import ROOT_UID, Context, DaemonState, authorize
from spswap.errors import SlotError
from spswap.liveness import Holder, pid_alive
from spswap.slots.table import Reservation, SlotTable


def op_slots_list(ctx: Context, args: dict[str, Any]) -> Answer:
    return ctx.state.slot_table().snapshot()


def op_slots_release(ctx: Context, args: dict[str, Any]) -> Answer:
    table = ctx.state.slot_table()
    rid = args["reservation_id"]
    for r in table.reservations():
        if r.id == rid:
            authorize(ctx.peer_uid, r.holder.uid, f"reservation {rid}")
    released = table.release(rid, uid=ctx.peer_uid)
    # the holder's event (their `spswap events` shows it); root releasing another's
    # reservation (a stuck holder) is said with by_uid
    forced = {"by_uid": ctx.peer_uid} if ctx.peer_uid != released.holder.uid else {}
    ctx.state.event("slots.release", job_id=released.holder.job_id, uid=released.holder.uid,
                    reservation=released.id, model=released.model, **forced)  # fmt: skip
    return released.to_json()


def op_slots_reserve(ctx: Context, args: dict[str, Any]) -> Answer:
    """Reserve for the caller; the wait happens here (this connection's thread only)."""
    holder = peer_holder(ctx, args.get("job_id"))
    cached = ctx.state.slot_table()
    allowed_gpus = job_gpus_only(ctx, holder.job_id, args.get("allowed_gpus"), cached.gpus)
    jobless_user = holder.job_id is None and ctx.peer_uid != ROOT_UID

    def grant_check(asker: Holder) -> Collection[int]:
        _requester_alive(asker)
        if not jobless_user:
            return ()
        return jobless_barred(ctx.state, asker, allowed_gpus or cached.gpus)

    table = SlotTable(cached.slots_dir, cached.gpus, job_alive=cached.job_alive,
                      poll_interval_s=cached.poll_interval_s,
                      grant_check=grant_check)  # fmt: skip
    res = table.reserve(
        model=args["model"], units=args.get("units", table.UNITS_PER_GPU),
        whole_gpus=args.get("whole_gpus"), allowed_gpus=allowed_gpus,
        holder=holder, timeout_s=float(args["timeout_s"]),
    )  # fmt: skip
    ctx.state.event("slots.reserve", job_id=holder.job_id, uid=holder.uid, pid=holder.pid,
                    reservation=res.id, model=res.model, gpus=list(res.gpus),
                    units=list(res.units))  # fmt: skip
    # the memory promised is the reservation's: trees other jobs keep on those GPUs move
    on_gpu.make_way(ctx.state, holder.job_id, res.gpus)
    return res.to_json()


def give_way_to_job(st: DaemonState, rec: JobRecord) -> list[Reservation]:
    """Take back the reservations users made outside any job on the GPUs Slurm has just
    given job ``rec`` (made before it was given them, they would keep the job's own
    reservations waiting until the program that made them ends), and those GPUs from
    such users' places in line (they would hold the job's back); each reservation an
    event."""
    if not rec.gpus:
        return []
    gpus = set(rec.gpus)

    def jobless_user(h: Holder) -> bool:
        return h.job_id is None and h.uid != ROOT_UID

    # (on the prolog's path: the lock is waited for 2 s at most)
    revoked = st.slot_table().take_back(gpus, jobless_user, timeout_s=2.0)
    for r in revoked:
        st.event("slots.revoked", job_id=rec.job_id, uid=r.holder.uid, pid=r.holder.pid,
                 reservation=r.id, model=r.model, gpus=list(r.gpus),
                 reason=f"job {rec.job_id} was given GPU(s) {sorted(gpus & set(r.gpus))}; "
                        "a user's reservation outside a job gives way to it")  # fmt: skip
    return revoked


def _requester_alive(holder: Holder) -> None:
    """The table's grant check: stop waiting once the requester has gone (its client was
    killed mid-wait): otherwise its queue ticket would hold back everyone behind it until
    the timeout."""
    if not pid_alive(holder.pid, holder.pid_start):
        raise SlotError(f"pid {holder.pid} asked for a slot and exited while waiting")
