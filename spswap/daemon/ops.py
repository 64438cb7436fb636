"""Every op spswapd answers, in one plain table: the op's name -> the function that
answers it. Each takes the request's :class:`~spswap.daemon.state.Context` and its args,
validated against :data:`spswap.daemon.protocol.OPS` (which lists the same names), and
returns a JSON-ready result or raises a :class:`~spswap.errors.SpswapError`. The server
looks ops up here only; no module adds to the table elsewhere."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spswap.daemon import ckpt_dump, ckpt_restore, ckpt_status, handlers
from spswap.daemon.state import Context

Handler = Callable[[Context, dict[str, Any]], Any]

HANDLERS: dict[str, Handler] = {
    "ping": handlers.op_ping,
    "status": handlers.op_status,
    "slots.list": handlers.op_slots_list,
    "slots.release": handlers.op_slots_release,
    "slots.reserve": handlers.op_slots_reserve,
    "pool.use": handlers.op_pool_use,
    "pool.unuse": handlers.op_pool_unuse,
    "pool.import": handlers.op_pool_import,
    "job.register": handlers.op_job_register,
    "job.end": handlers.op_job_end,
    "jobs.list": handlers.op_jobs_list,
    "events.tail": handlers.op_events_tail,
    "checkpoint": ckpt_dump.op_checkpoint,
    "restore": ckpt_restore.op_restore,
    "checkpoint.status": ckpt_status.op_checkpoint_status,
}
