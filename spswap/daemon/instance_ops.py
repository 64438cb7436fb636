"""``instance.put`` and ``instance.remove``: a user's serving process keeps its record in
``run/instances/`` (what ``spswap status`` lists) through the daemon, since that folder
is root's (issue 15 item 7: every state change of a user's instance logged "could not
update the instance record ([Errno 13] Permission denied)").

The record is about the caller: its uid and pid are the kernel's (SO_PEERCRED), whatever
the request says; a user's id carries the caller's pid, and a record of another uid's
live process is neither overwritten nor removed. Its fields are text of bounded length
(they are shown in every user's `spswap status`). Each uid keeps at most
:data:`MAX_RECORDS_PER_UID` records (a dead instance's stays, as a root-written one
does, until its id is used again, root removes it, or its job will not come back:
:func:`spswap.daemon.job_ops.forget_instances`).
"""

from __future__ import annotations

import re
from typing import Any

from spswap.daemon.jobs import check_job_id
from spswap.daemon.protocol import Answer
from spswap.daemon.state import ROOT_UID, Context, DaemonState, authorize
from spswap.errors import BadRequest, RequestRefused
from spswap.instance.registry import InstanceRecord, InstanceRegistry

MAX_RECORDS_PER_UID = 64
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def registry_of(st: DaemonState) -> InstanceRegistry:
    """The node's instance records (``run/instances/``), as the daemon writes them."""
    return InstanceRegistry(st.cfg.paths.instances)


def _checked_id(value: Any) -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise BadRequest(f"instance id {value!r}: use letters, digits, '.', '_' and '-' "
                          "(at most 128), starting with a letter or digit")  # fmt: skip
    return value


# the text fields of a record, and how long each may be: they go into other users'
# `spswap status` (a number where text belongs broke every user's status)
TEXT_FIELDS = {"model": 256, "state": 64, "device": 64, "engine": 64}
MAX_REASON_CHARS = 4096


def checked_record(fields: dict[str, Any]) -> InstanceRecord:
    """The record ``fields`` make, or BadRequest naming the field that is not as it must be."""
    try:
        record = InstanceRecord.from_json(fields)
    except TypeError as e:
        raise BadRequest(f"not an instance record ({e}); give id, model and state") from None
    for name, most in TEXT_FIELDS.items():
        value = getattr(record, name)
        if not isinstance(value, str) or len(value) > most:
            raise BadRequest(f"an instance record's {name} is text of at most {most} "
                             f"characters, not {str(value)[:40]!r}")  # fmt: skip
    if record.reason is not None and (not isinstance(record.reason, str)
                                      or len(record.reason) > MAX_REASON_CHARS):  # fmt: skip
        raise BadRequest(f"an instance record's reason is text of at most {MAX_REASON_CHARS} "
                         "characters, or null")  # fmt: skip
    if record.job_id is not None:
        if not isinstance(record.job_id, str):
            raise BadRequest("an instance record's job_id is text, or null")
        check_job_id(record.job_id)
    return record


def _carries_pid(instance_id: str, pid: int) -> bool:
    """True when the id's second '-' field is ``pid`` (serve's ids are ``<job>-<pid>``,
    a multi-model job's ``<job>-<pid>-<model>``; job ids hold no '-'): no user can take
    the id of another's live instance ahead of it."""
    fields = instance_id.split("-")
    return len(fields) > 1 and fields[1] == str(pid)


def op_instance_put(ctx: Context, args: dict[str, Any]) -> Answer:
    fields = dict(args["record"])
    instance_id = _checked_id(fields.get("id"))
    if ctx.peer_uid != ROOT_UID and not _carries_pid(instance_id, ctx.peer_pid):
        raise BadRequest(f"instance id {instance_id!r} does not carry your process's pid "
                         f"({ctx.peer_pid}): a user's ids are <job>-<pid>[-<model>]")  # fmt: skip
    fields.update(uid=ctx.peer_uid, pid=ctx.peer_pid)  # the caller's, as the kernel says
    record = checked_record(fields)
    registry = registry_of(ctx.state)
    mine = 0
    for other, alive in registry.list():
        if other.id == instance_id:
            # a record whose process is gone (its pid dead, or now the caller's) is replaced
            if alive and other.pid != ctx.peer_pid:
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
    registry = registry_of(ctx.state)
    for other, _alive in registry.list():
        if other.id == instance_id:
            authorize(ctx.peer_uid, other.uid, f"instance record {instance_id}")
            registry.remove(instance_id)
            return {"removed": True}
    return {"removed": False}
