"""Every op spswapd answers, in one plain table: the op's name -> the function that
answers it. Each takes the request's :class:`~spswap.daemon.state.Context` and its args,
validated against :data:`spswap.daemon.protocol.OPS` (which lists the same names), and
returns a JSON-ready result or raises a :class:`~spswap.errors.SpswapError`. The server
looks ops up here only; no module adds to the table elsewhere."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from spswap.daemon import (
    ckpt_dump,
    ckpt_restore,
    ckpt_status,
    info_ops,
    instance_ops,
    job_ops,
    pool_ops,
    slot_ops,
)
from spswap.daemon.protocol import Answer
from spswap.daemon.state import Context

Handler = Callable[[Context, dict[str, Any]], Answer]

# read-only: nothing adds an op after this module is loaded
HANDLERS: Mapping[str, Handler] = MappingProxyType(
    {
        "ping": info_ops.op_ping,
        "status": info_ops.op_status,
        "slots.list": slot_ops.op_slots_list,
        "slots.release": slot_ops.op_slots_release,
        "slots.reserve": slot_ops.op_slots_reserve,
        "pool.use": pool_ops.op_pool_use,
        "pool.unuse": pool_ops.op_pool_unuse,
        "pool.import": pool_ops.op_pool_import,
        "pool.check": pool_ops.op_pool_check,
        "job.register": job_ops.op_job_register,
        "job.end": job_ops.op_job_end,
        "job.starting": job_ops.op_job_starting,
        "jobs.list": info_ops.op_jobs_list,
        "images.remove": job_ops.op_images_remove,
        "events.tail": info_ops.op_events_tail,
        "checkpoint": ckpt_dump.op_checkpoint,
        "restore": ckpt_restore.op_restore,
        "checkpoint.status": ckpt_status.op_checkpoint_status,
        "instance.put": instance_ops.op_instance_put,
        "instance.remove": instance_ops.op_instance_remove,
    }
)
