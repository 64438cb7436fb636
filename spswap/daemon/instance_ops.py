"""``instance.put`` and ``instance.remove``: a user's serving process keeps its record in
``run/instances/`` (what ``spswap status`` lists) through the daemon, since that folder
is root's (issue 15 item 7: every state change of a user's instance logged "could not
update the instance record ([Errno 13] Permission denied)").

The record is about the caller: its uid and pid are the kernel's (SO_PEERCRED), whatever
the request says, and a record of another uid's is neither overwritten nor removed. Each
uid keeps at most :data:`MAX_RECORDS_PER_UID` records (a dead instance's stays, as a
root-written one does, until its process's id is reused or root removes it).
"""

from __future__ import annotations

import re
from typing import Any

from spswap.daemon.protocol import Answer
from spswap.daemon.state import ROOT_UID, Context, authorize
from spswap.errors import BadRequest, RequestRefused
from spswap.instance.registry import InstanceRecord, InstanceRegistry

MAX_RECORDS_PER_UID = 64
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _registry(ctx: Context) -> InstanceRegistry:
    return InstanceRegistry(ctx.state.cfg.paths.run / "instances")


def _checked_id(value: Any) -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise BadRequest(f"instance id {value!r}: use letters, digits, '.', '_' and '-' "
                          "(at most 128), starting with a letter or digit")  # fmt: skip
    return value


def op_instance_put(ctx: Context, args: dict[str, Any]) -> Answer:
    fields = dict(args["record"])
    instance_id = _checked_id(fields.get("id"))
    fields.update(uid=ctx.peer_uid, pid=ctx.peer_pid)  # the caller's, as the kernel says
    try:
        record = InstanceRecord.from_json(fields)
    except TypeError as e:
        raise BadRequest(f"not an instance record ({e}); give id, model and state") from None
    if not all(isinstance(getattr(record, k), str) for k in ("model", "state")):
        raise BadRequest("an instance record's model and state are text")
    registry = _registry(ctx)
    mine = 0
    for other, _alive in registry.list():
        if other.id == instance_id:
            authorize(ctx.peer_uid, other.uid, f"instance record {instance_id}")
        elif other.uid == ctx.peer_uid:
            mine += 1
    if ctx.peer_uid != ROOT_UID and mine >= MAX_RECORDS_PER_UID:
        raise RequestRefused(f"you have {mine} instance records on this node, the most one user "
                          "may keep; ask root to remove those of ended instances")  # fmt: skip
    registry.directory.mkdir(mode=0o755, exist_ok=True)
    registry.put(record)
    return {"id": instance_id}


def op_instance_remove(ctx: Context, args: dict[str, Any]) -> Answer:
    instance_id = _checked_id(args["id"])
    registry = _registry(ctx)
    for other, _alive in registry.list():
        if other.id == instance_id:
            authorize(ctx.peer_uid, other.uid, f"instance record {instance_id}")
            registry.remove(instance_id)
            return {"removed": True}
    return {"removed": False}
