"""spswapd's state: the one object every op reaches through its request's
:class:`Context`, and who may act on what (:func:`authorize`).

A leaf of the daemon: it imports none of the ops modules (the ``*_ops`` and ``ckpt_*``
ones and the rest import it), so no module needs another's private names to reach it. What
the daemon keeps in memory between requests lives here as fields of one
:class:`DaemonState`, never in module globals: the slot table and job probe (caches of
what is on tmpfs), this host's node names, the kept trees, the dumps in progress and the
per-job checkpoint locks. The truth is on tmpfs: a daemon that dies loses only what its
successor's start-up rebuilds (:mod:`spswap.daemon.ckpt_recover`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spswap.checkpoint.images import pool_digests
from spswap.config import Config
from spswap.daemon import events
from spswap.daemon.image_room import ImageRoom
from spswap.daemon.jobs import JobRecord, JobState, JobStore
from spswap.daemon.kept import HeldCgroups, KeptTrees
from spswap.daemon.memory_claims import MemoryClaims
from spswap.daemon.pool_checks import PoolChecks
from spswap.daemon.statuses import CheckpointStatuses
from spswap.errors import PermissionDenied, RequestRefused, SpswapError
from spswap.liveness import JobProbe
from spswap.slots.table import SlotTable
from spswap.slurm.backend import get_backend, job_probe

if TYPE_CHECKING:
    from spswap.slurm.parse import JobInfo

ROOT_UID = 0
ASK_SLURM_TIMEOUT_S = 5.0  # the epilog (and a request) must not hang on a controller that is down


def authorize(peer_uid: int, owner_uid: int, what: str) -> None:
    """Root may act on anything; anyone else only on what ``owner_uid`` owns."""
    if peer_uid != ROOT_UID and peer_uid != owner_uid:
        raise PermissionDenied(
            f"{what} belongs to uid {owner_uid}, not to you (uid {peer_uid}); ask its owner or root"
        )


def require_root(peer_uid: int, op: str, who: str = "the Slurm prolog/epilog (root)") -> None:
    """Only root (``who``: by default the Slurm prolog and epilog) may ask for ``op``."""
    if peer_uid != ROOT_UID:
        raise PermissionDenied(f"{op} is for {who} only; you are uid {peer_uid}")


class JobLocks:
    """One checkpoint or restore of a job at a time (a second would delete the first's
    image under it): a lock per job id, made on first use."""

    def __init__(self) -> None:
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def of(self, job_id: str) -> threading.Lock:
        """The job's lock (the same object for every caller)."""
        with self._guard:
            return self._locks.setdefault(job_id, threading.Lock())


class DumpsInProgress:
    """The jobs this daemon dumps now, with the pool entry (model digest) each one's
    process maps: the image-use count holds those entries until the dump ends.

    ``lock`` is re-entrant and also held by the whole re-count
    (:func:`spswap.daemon.image_uses.sync_image_uses`), so a dump never starts or ends
    halfway through one."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._digests: dict[str, str] = {}  # job id -> model digest

    def hold(self, job_id: str, digest: str) -> None:
        """While this daemon dumps the job, its pool entry ``digest`` is held."""
        with self.lock:
            self._digests[job_id] = digest

    def end(self, job_id: str) -> None:
        """The dump ended: from now on its image holds the entry, or nothing does."""
        with self.lock:
            self._digests.pop(job_id, None)

    def digests(self) -> list[tuple[str, str]]:
        """The entries held for dumps in progress: (job, digest), one per dump and entry
        it needs."""
        with self.lock:
            return [(job, d) for job, needed in self._digests.items()
                    for d in pool_digests(needed)]  # fmt: skip


@dataclass
class DaemonState:
    """What the daemon keeps between requests, owned by this one object: caches (the
    truth is on tmpfs) and the in-memory records of its checkpoint work."""

    cfg: Config
    started_at: float = field(default_factory=time.time)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _slot_table: SlotTable | None = None
    _job_probe: JobProbe | None = None
    _probe_loaded: bool = False
    # Slurm's names of this host's node(s), as the prologs gave them (several where one
    # host runs several slurmd)
    node_names: set[str] = field(default_factory=set)
    dumping: DumpsInProgress = field(default_factory=DumpsInProgress)
    job_locks: JobLocks = field(default_factory=JobLocks)
    statuses: CheckpointStatuses = field(init=False)  # the jobs' checkpoint status files
    kept: KeptTrees = field(init=False)  # the dumped trees kept alive beside their images
    # the emptied parked cgroups of dumps that left images (spswap.daemon.prerestore)
    held_cgroups: HeldCgroups = field(init=False)
    memory_claims: MemoryClaims = field(init=False)
    pool_checks: PoolChecks = field(init=False)  # pool.check: entries found whole, its lock
    image_room: ImageRoom = field(init=False)  # the images' budget, dumps under way
    event_log: events.EventLog = field(init=False)  # the log's writer (and its new files)
    # the uid whose request this thread answers now (set by the server): its events count
    # in that user's allowance; the prolog's, the epilog's and the daemon's own do not
    requests: threading.local = field(init=False)

    def __post_init__(self) -> None:
        self.statuses = CheckpointStatuses(self.cfg.paths.run / "checkpoints")
        self.kept = KeptTrees(self.statuses, self.event)
        self.held_cgroups = HeldCgroups()
        self.memory_claims = MemoryClaims()
        self.pool_checks = PoolChecks()
        self.event_log = events.EventLog(self.cfg.paths.events)
        self.requests = threading.local()
        self.image_room = ImageRoom.from_config(self.cfg)

    @property
    def jobs(self) -> JobStore:
        return JobStore(self.cfg.paths.run / "jobs")

    def event(self, kind: str, **fields: Any) -> None:
        """Append an event; one about a job carries its owner's uid (the job's record)
        unless the caller gave one, so ``spswap events`` shows whose job each line is."""
        job_id = fields.get("job_id")
        if fields.get("uid") is None and job_id:
            fields["uid"] = self._job_uid(str(job_id))
        self.event_log.append(kind, charge_uid=getattr(self.requests, "uid", None), **fields)

    def event_quietly(self, kind: str, **fields: Any) -> None:
        """:meth:`event` for a caller that must go on whatever happens (a dump, a daemon
        thread): a full event log loses the line, nothing else."""
        try:
            self.event(kind, **fields)
        except OSError:
            pass

    def _job_uid(self, job_id: str) -> int | None:
        try:
            rec = self.jobs.get(job_id)
        except (SpswapError, OSError, ValueError):  # an event is never lost for this
            return None
        return rec.uid if rec is not None and rec.uid >= 0 else None

    def job_probe(self) -> JobProbe | None:
        """Is this job alive: Slurm's answer when it can give one, else what the prolog
        and epilog recorded (a job registered here and not ended is alive)."""
        if not self._probe_loaded:
            self._probe_loaded = True

            slurm = job_probe()

            def probe(job_id: str) -> bool | None:
                verdict = slurm(job_id) if slurm is not None else None
                if verdict is not None:
                    return verdict
                try:
                    rec = self.jobs.get(job_id)
                except SpswapError:  # not a job id we could have recorded
                    return None
                return None if rec is None else rec.state is JobState.RUNNING

            self._job_probe = probe
        return self._job_probe

    def slot_table(self) -> SlotTable:
        # GPU discovery may touch NVML (slow without persistence mode): do it once
        if self._slot_table is None:
            self._slot_table = SlotTable.from_config(self.cfg, job_alive=self.job_probe())
        return self._slot_table

    def ask_slurm(self, job_id: str) -> tuple[JobInfo | None, bool]:
        """Slurm's JobInfo of the job (None: not known or not asked) and whether Slurm
        answered at all; an unreachable controller is logged, never raised."""
        try:
            backend = get_backend(timeout_s=ASK_SLURM_TIMEOUT_S)
            if backend is None:
                return None, False
            return backend.job(job_id), True
        except SpswapError as e:
            self.event("job.end_slurm_unreachable", job_id=job_id, reason=str(e)[:500])
            return None, False


@dataclass(frozen=True)
class Context:
    """One request's caller and the daemon it reached."""

    peer_uid: int
    peer_pid: int
    state: DaemonState
    fds: tuple[int, ...] = ()
    """File descriptors that came with the request (SCM_RIGHTS); the server closes them."""

    def job_for(self, job_id: str) -> JobRecord:
        """The job's record on this node, when the caller may act on it (its own, or
        root's); refused when no prolog registered it here."""
        rec = self.state.jobs.get(job_id)
        if rec is None:
            raise RequestRefused(
                f"job {job_id} is not registered on this node (its prolog did not run here); "
                "see `spswap status`"
            )
        authorize(self.peer_uid, rec.uid, f"job {job_id}")
        return rec
