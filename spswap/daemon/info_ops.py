"""The ops that tell what the daemon knows: ``ping``, ``status``, ``jobs.list`` and
``events.tail``; a user sees only their own jobs and events, root everything."""

from __future__ import annotations

import os
import time
from typing import Any

from spswap import __version__
from spswap.daemon import events
from spswap.daemon.jobs import JobState
from spswap.daemon.protocol import PROTOCOL_VERSION, Answer
from spswap.daemon.state import ROOT_UID, Context
from spswap.settings_check import settings_problems
from spswap.settings_file import settings_file_path


def op_ping(ctx: Context, args: dict[str, Any]) -> Answer:
    return {"pong": True, "pid": os.getpid(), "protocol": PROTOCOL_VERSION}


def op_status(ctx: Context, args: dict[str, Any]) -> Answer:
    st = ctx.state
    return {
        "pid": os.getpid(),
        "version": __version__,
        "protocol": PROTOCOL_VERSION,
        "root": str(st.cfg.root),
        "socket": str(st.cfg.paths.socket),
        "started_at": st.started_at,
        "uptime_s": round(time.time() - st.started_at, 3),
        "jobs": sum(1 for j in st.jobs.all() if j.state is JobState.RUNNING),
        "nodes": sorted(st.node_names),  # Slurm's names of this host's node(s), from prologs
        # its own settings and where they came from: a command that reads others (another
        # environment) can tell, and say so (spswap status)
        "settings": st.cfg.to_json(),
        "settings_file": str(settings_file_path(os.environ)),
        "gpus": list(st.slot_table().gpus),
        "settings_problems": settings_problems(st.cfg),
    }


def op_jobs_list(ctx: Context, args: dict[str, Any]) -> Answer:
    """Root sees every job; a user only their own."""
    return [j.to_json() for j in ctx.state.jobs.all()
            if ctx.peer_uid == ROOT_UID or j.uid == ctx.peer_uid]  # fmt: skip


MAX_TAIL_EVENTS = 1000  # what one request may read (each event at most MAX_EVENT_BYTES)


def op_events_tail(ctx: Context, args: dict[str, Any]) -> Answer:
    """The last ``n`` events (at most :data:`MAX_TAIL_EVENTS`): root sees every event; a
    user only those about their own jobs and processes."""
    n = min(max(int(args.get("n", 50)), 0), MAX_TAIL_EVENTS)
    tail = events.tail(ctx.state.cfg.paths.events, n)
    if ctx.peer_uid == ROOT_UID:
        return tail
    return [e for e in tail if e.get("uid") == ctx.peer_uid]
