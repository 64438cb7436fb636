"""The slot ops: ``slots.list``, ``slots.reserve`` (the caller waits in line on its own
connection's thread) and ``slots.release`` (only the holder's own, or root)."""

from __future__ import annotations

from typing import Any

from spswap.daemon.caller import job_gpus_only, peer_holder
from spswap.daemon.protocol import Answer
from spswap.daemon.state import Context, authorize
from spswap.errors import SlotError
from spswap.liveness import Holder, pid_alive
from spswap.slots.table import SlotTable


def op_slots_list(ctx: Context, args: dict[str, Any]) -> Answer:
    return ctx.state.slot_table().snapshot()


def op_slots_release(ctx: Context, args: dict[str, Any]) -> Answer:
    table = ctx.state.slot_table()
    rid = args["reservation_id"]
    for r in table.reservations():
        if r.id == rid:
            authorize(ctx.peer_uid, r.holder.uid, f"reservation {rid}")
    released = table.release(rid, uid=ctx.peer_uid)
    ctx.state.event("slots.release", job_id=released.holder.job_id, uid=ctx.peer_uid,
                    reservation=released.id, model=released.model)  # fmt: skip
    return released.to_json()


def op_slots_reserve(ctx: Context, args: dict[str, Any]) -> Answer:
    """Reserve for the caller; the wait happens here (this connection's thread only)."""
    holder = peer_holder(ctx, args.get("job_id"))
    cached = ctx.state.slot_table()
    allowed_gpus = job_gpus_only(ctx, holder.job_id, args.get("allowed_gpus"), cached.gpus)
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
