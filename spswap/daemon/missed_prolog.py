"""A job run whose prolog never reached spswapd.

slurmd does not always run the Prolog for a requeued job that comes straight back to the
node it just left: seen with Slurm 22.05 and ``PrologFlags=Alloc`` after spswap's early
requeue, where slurmd logs "reissued job credential" and starts the batch script with no
prolog. spswapd's record then still says the last run ended (its epilog came) while the
new run works. Such a run is registered at its first request that needs a running job (a
checkpoint, a restore, a reservation or pool use bound to the job), once Slurm says the
job runs on this node as the user the record has: without that, the requeued run could
not get its image or kept instance back and would start cold.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import TYPE_CHECKING

from spswap.daemon.jobs import JobRecord, JobState
from spswap.slurm.parse import JobInfo, expand_hostlist

if TYPE_CHECKING:
    from spswap.daemon.state import DaemonState

REGISTERED_BY = "first request: Slurm runs the job here and no prolog reached spswapd"


def _nodes(text: str) -> set[str]:
    try:
        return set(expand_hostlist(text))
    except ValueError:
        return set()


def missed_run(rec: JobRecord, info: JobInfo | None, node_names: Collection[str],
               now: float) -> JobRecord | None:  # fmt: skip
    """The record of the run Slurm says ``rec``'s job runs now on this node (one of
    ``node_names``, the names its prologs gave), when no prolog registered it; None when
    the record says running already, or Slurm does not say so: not known, not RUNNING,
    another user's, on other nodes, an older run than the one recorded, or no node name
    to tell. GPUs: Slurm's for this node, else the job's when it has one node, else the
    last run's. Pure."""
    if rec.state is JobState.RUNNING or info is None or not info.running:
        return None
    if info.uid is None or info.uid != rec.uid or info.restart_count < rec.restart_count:
        return None
    held = _nodes(info.nodes or "")
    here = held & set(node_names)
    if not here:
        return None
    gpus = next((list(g) for nodes, g in info.gpus_by_node.items() if _nodes(nodes) & here),
                None)  # fmt: skip
    if gpus is None:
        gpus = list(info.gpus) if len(held) == 1 else list(rec.gpus)
    return JobRecord(job_id=rec.job_id, uid=rec.uid, user=rec.user, gpus=gpus,
                     restart_count=info.restart_count, registered_at=now)  # fmt: skip


def register_missed_run(st: DaemonState, rec: JobRecord) -> JobRecord:
    """``rec`` while it says running; else the run Slurm says runs here, registered now
    (see the module's text and :func:`missed_run`); else ``rec`` as it was, for the caller
    to refuse. Asks Slurm only for a record that does not say running."""
    if rec.state is JobState.RUNNING:
        return rec
    info, _ = st.ask_slurm(rec.job_id)
    new = missed_run(rec, info, st.node_names, time.time())
    if new is None:
        return rec
    with st.lock:
        current = st.jobs.get(rec.job_id)
        if current is not None and current.state is JobState.RUNNING:
            return current  # its prolog came meanwhile
        st.jobs.put(new)
    st.event("job.start", job_id=new.job_id, uid=new.uid, user=new.user, gpus=new.gpus,
             restart_count=new.restart_count, registered_by=REGISTERED_BY)  # fmt: skip
    return new
