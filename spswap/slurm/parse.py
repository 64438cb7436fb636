"""Pure parsers of Slurm's text: string in, data out. No subprocess here.

Formats are those of Slurm 22.05 (pinned by captured outputs in
``tests/fixtures/slurm/``): ``scontrol show job -d JOB`` (multi-line, what the backend
reads), ``scontrol show job -o -d JOB`` (one line of ``Key=value`` per job) and
``squeue --json`` (openapi v0.0.38; it ignores ``-j``: filter here).
Malformed text raises :class:`ValueError`; the backend turns it into a
:class:`~spswap.errors.SlurmCommandError` that carries the command.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

# States in which a job still has its allocation on a node (its processes may run).
ALLOCATED_STATES = frozenset(
    {"RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING", "STOPPED", "RESIZING",
     "SIGNALING", "STAGE_OUT"}
)  # fmt: skip
# an ended job that will run again, and one that will not (see job_fate)
COMING_BACK_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                                "SPECIAL_EXIT"})  # fmt: skip
GONE_STATES = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL",
                         "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED",
                         "REVOKED"})  # fmt: skip

# Fields whose value is free text and may contain spaces and "x=y" words. Inside one of
# them, only a key from KNOWN_KEYS starts the next field.
FREE_TEXT_KEYS = frozenset(
    {"JobName", "Comment", "AdminComment", "SystemComment", "Command", "WorkDir",
     "StdErr", "StdIn", "StdOut", "Reason", "Features", "Network", "Licenses"}
)  # fmt: skip
KNOWN_KEYS = frozenset(
    "JobId JobName UserId GroupId MCS_label Priority Nice Account QOS JobState Reason "
    "Dependency Requeue Restarts BatchFlag Reboot ExitCode DerivedExitCode RunTime "
    "TimeLimit TimeMin SubmitTime EligibleTime AccrueTime StartTime EndTime Deadline "
    "PreemptEligibleTime PreemptTime SuspendTime SecsPreSuspend LastSchedEval Scheduler "
    "Partition AllocNode:Sid ReqNodeList ExcNodeList NodeList BatchHost NumNodes NumCPUs "
    "NumTasks CPUs/Task ReqB:S:C:T TRES Socks/Node NtasksPerN:B:S:C CoreSpec JOB_GRES "
    "Nodes CPU_IDs Mem GRES MinCPUsNode MinMemoryNode MinTmpDiskNode Features DelayBoot "
    "OverSubscribe Contiguous Licenses Network Command WorkDir Comment AdminComment "
    "SystemComment StdErr StdIn StdOut Power TresPerNode TresPerJob MemPerNode MemPerCPU "
    "ArrayJobId ArrayTaskId ArrayTaskThrottle HetJobId HetJobOffset HetJobIdSet "
    "Reservation Container ContainerID CpusPerTres MemPerTres TresBind TresFreq "
    "MailUser MailType NtasksPerTRES Prefer ClusterFeatures BurstBuffer "
    "BurstBufferState Partitions Cluster".split()
)  # fmt: skip
_KEY_AT = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/]*)=")
_NODE_GRES = re.compile(r"(?:^|\s)Nodes=(\S+) CPU_IDs=\S* Mem=\S* GRES=(\S*)", re.MULTILINE)
_GPU_IDX = re.compile(r"(?:^|,)gpu(?::[^:(,]+)?:\d+\(IDX:([0-9,\-]+)\)")


@dataclass(frozen=True)
class JobInfo:
    """A job as the controller sees it."""

    job_id: str
    state: str
    """Slurm's state name, upper case: PENDING, RUNNING, COMPLETED, CANCELLED, ..."""
    restart_count: int = 0
    uid: int | None = None
    partition: str | None = None
    reason: str | None = None
    gpus: tuple[int, ...] = ()
    """GPU indexes allocated on the job's nodes (union over nodes)."""
    gpus_by_node: dict[str, tuple[int, ...]] = field(default_factory=dict, hash=False)
    """Node (or node range, e.g. ``n[1-2]``) -> GPU indexes there."""
    comment: str | None = None
    nodes: str | None = None
    """The nodes the job holds or last held, as Slurm writes them (``n[1-3],gpu7``)."""
    work_dir: str | None = None
    """The job's working directory (``sbatch --chdir``, else where it was submitted)."""
    std_out: str | None = None
    """Where the job's output goes (``sbatch --output``, expanded), where shown."""
    requeue: bool | None = None
    """Whether Slurm may requeue the job (``Requeue=1``: ``--requeue``, or slurm.conf's
    ``JobRequeue=1``, the default, without ``--no-requeue``); None when not shown."""
    eligible_s: float | None = None
    """When the job may start (``EligibleTime``, epoch seconds, to Slurm's second): a
    requeued job's is its requeue + ``AuthInfo=cred_expire`` + 1 s; None when not shown."""

    @property
    def allocated(self) -> bool:
        """True while the job holds its nodes (running, suspended, completing...)."""
        return self.state in ALLOCATED_STATES

    @property
    def running(self) -> bool:
        """True while the job runs (not pending, suspended or completing)."""
        return self.state == "RUNNING"

    def runs_elsewhere(self, here: Collection[str]) -> bool:
        """Whether the job holds nodes now and none of them is one of ``here`` (this
        host's Slurm node names: several where one host runs several slurmd): its run is
        somewhere else. False whenever that cannot be told (no names, no node list)."""
        if not here or not self.nodes or not self.allocated:
            return False
        try:
            held = expand_hostlist(self.nodes)
        except ValueError:
            return False
        return bool(held) and not set(held) & set(here)


def job_fate(slurm_state: str | None, requeued: bool | None, slurm_restarts: int | None = None,
             run_restart_count: int | None = None) -> str:  # fmt: skip
    """Whether an ended job will run again: "back", "gone" or "unknown".

    ``slurm_state``: the controller's state name (None when Slurm does not know the job
    or cannot be asked); ``requeued``: what the epilog was told, when it was. A job still
    COMPLETING whose restart count Slurm already raised past the run's
    (``run_restart_count``) was requeued (see :func:`stopped_for_good`).
    """
    state = (slurm_state or "").upper().split()[0] if slurm_state else ""
    if state in COMING_BACK_STATES:
        return "back"
    if state in GONE_STATES:
        return "gone"
    if (state == "COMPLETING" and slurm_restarts is not None and run_restart_count is not None
            and slurm_restarts > run_restart_count):  # fmt: skip
        return "back"
    # not known to Slurm, or still COMPLETING (a requeued job looks the same then)
    if requeued is None:
        return "unknown"
    return "back" if requeued else "gone"


def stopped_for_good(slurm_state: str | None, slurm_restarts: int | None = None,
                     run_restart_count: int | None = None) -> bool:  # fmt: skip
    """Whether a job that is being stopped now will never run again, so a checkpoint of
    it would be wasted: Slurm calls it ended (cancelled, out of time, failed), or it is
    COMPLETING (what Slurm 22.05 shows while it kills a job, for ``scancel`` and for a
    requeue alike) and its restart count is still this run's (a requeue raises it at
    once; measured on 22.05). PREEMPTED is not counted: with PreemptMode=REQUEUE the job
    comes back, and a dump missed costs a cold start where a needless one costs only
    memory until spswapd frees it."""
    state = (slurm_state or "").upper().split()[0] if slurm_state else ""
    if state in GONE_STATES and state != "PREEMPTED":
        return True
    return (state == "COMPLETING" and slurm_restarts is not None
            and slurm_restarts == run_restart_count)  # fmt: skip


_RANGE_GROUP = re.compile(r"\[([^\]]*)\]")


def expand_hostlist(text: str) -> list[str]:
    """Slurm's node list as names: ``"n[01-03,7],gpu1"`` -> ``["n01", "n02", "n03",
    "n7", "gpu1"]`` (zero padding kept; several bracket groups in one name multiply).
    Raises ValueError on text that is not a node list."""
    names: list[str] = []
    depth, start = 0, 0
    parts = []
    for i, ch in enumerate(text):  # commas inside brackets separate ranges, not names
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"not a node list: {text!r}")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"not a node list: {text!r}")
    parts.append(text[start:])
    for part in (p.strip() for p in parts):
        if part:
            names += _expand_name(part)
    return names


def _expand_name(part: str) -> list[str]:
    match = _RANGE_GROUP.search(part)
    if match is None:
        return [part]
    head, tail = part[: match.start()], part[match.end() :]
    out = []
    for item in match.group(1).split(","):
        low, dash, high = item.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"not a node range: {item!r} in {part!r}")
        width = len(low)
        if int(high or low) < int(low):
            raise ValueError(f"not a node range: {item!r} in {part!r}")
        for n in range(int(low), int(high or low) + 1):
            out += _expand_name(f"{head}{n:0{width}d}{tail}")
    return out


def parse_scontrol_show_jobs(text: str) -> list[dict[str, str]]:
    """Every job of ``scontrol show job [-d] [-o]`` output, in either layout."""
    if _is_multiline(text):
        blocks = re.split(r"\n\s*\n", text.strip())
    else:
        blocks = text.splitlines()
    return [parse_scontrol_show_job(block) for block in blocks if block.strip()]


def _is_multiline(text: str) -> bool:
    return "\n   " in text.strip("\n")


def parse_scontrol_show_job(text: str) -> dict[str, str]:
    """One job of ``scontrol show job [-d]`` (multi-line) or ``... -o`` (one line).

    Prefer the multi-line layout: there Slurm puts each free-text field (``JobName``
    after ``JobId`` on the first line; ``Comment``, ``WorkDir``, ``Command``, ``Std*``)
    on a line of its own, so a job named ``x JobState=COMPLETED`` cannot forge a field.
    In the ``-o`` layout values may still contain ``=`` (``TRES=cpu=1,node=1``); inside a
    free-text field only one of Slurm's field names ends it, which a name crafted with
    field names defeats: use ``-o`` for display only. Repeated keys (per-node
    ``Nodes=... GRES=...`` with ``-d``) keep their first value; see :func:`parse_node_gres`.
    """
    if not text.strip().startswith("JobId="):
        raise ValueError(f"not `scontrol show job` output: {text.strip()[:120]!r}")
    if not _is_multiline(text):
        line = text.strip()
        if "\n" in line:
            raise ValueError("expected one job (one line of `scontrol show job -o`), got several")
        return _split_fields(line, free_text=True)
    fields: dict[str, str] = {}
    for number, raw in enumerate(text.strip("\n").splitlines()):
        line = raw.strip()
        key = line.partition("=")[0]
        if number == 0:
            job_id, _, name = line.partition(" JobName=")
            fields["JobId"] = job_id.removeprefix("JobId=")
            fields["JobName"] = name
        elif key in FREE_TEXT_KEYS and key not in _SPLITTABLE_IN_MULTILINE:
            fields.setdefault(key, line[len(key) + 1 :].strip())
        elif line:
            for k, v in _split_fields(line, free_text=False).items():
                fields.setdefault(k, v)
    return fields


# In the multi-line layout these share a line with other fields: split them normally.
_SPLITTABLE_IN_MULTILINE = frozenset({"Reason", "Features", "Network", "Licenses"})


def _split_fields(line: str, *, free_text: bool) -> dict[str, str]:
    fields: dict[str, str] = {}
    key: str | None = None
    value_start = 0
    for match in _KEY_AT.finditer(line):
        if key is not None:
            if free_text and key in FREE_TEXT_KEYS and match.group(1) not in KNOWN_KEYS:
                continue
            fields.setdefault(key, line[value_start : match.start()].strip())
        key, value_start = match.group(1), match.end()
    if key is not None:
        fields.setdefault(key, line[value_start:].strip())
    return fields


def parse_gpu_indexes(gres: str) -> tuple[int, ...]:
    """GPU indexes in a GRES detail string: ``"gpu:a100:2(IDX:0,2-3)"`` -> ``(0, 2, 3)``."""
    indexes: set[int] = set()
    for match in _GPU_IDX.finditer(gres):
        for part in match.group(1).split(","):
            if not part:
                continue
            low, _, high = part.partition("-")
            indexes.update(range(int(low), int(high or low) + 1))
    return tuple(sorted(indexes))


def parse_node_gres(text: str) -> dict[str, tuple[int, ...]]:
    """Per-node GPU indexes from ``scontrol show job -o -d`` (``Nodes=n1 ... GRES=...``)."""
    return {m.group(1): parse_gpu_indexes(m.group(2)) for m in _NODE_GRES.finditer(text)}


def _union(by_node: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    return tuple(sorted({gpu for gpus in by_node.values() for gpu in gpus}))


def parse_slurm_time(text: str | None) -> float | None:
    """Slurm's ``2026-12-04T02:33:28`` (scontrol prints it in its own time zone, which a
    command spswap runs shares) as epoch seconds; None for ``Unknown``, ``None``, ``N/A``
    (and any other form: spswap runs Slurm's commands with ``SLURM_TIME_FORMAT=standard``)."""
    try:
        return time.mktime(time.strptime(text or "", "%Y-%m-%dT%H:%M:%S"))
    except (ValueError, OverflowError):
        return None


def epoch_seconds(raw: Any) -> float | None:
    """A time as Slurm's APIs give it: an int (squeue --json of 22.05, pyslurm) or
    ``{"set": ..., "number": ...}`` (later squeue --json); 0 or unset: None."""
    if isinstance(raw, dict):
        raw = raw.get("number") if raw.get("set", True) else None
    return float(raw) if isinstance(raw, int) and raw > 0 else None


def _null(value: str | None) -> str | None:
    return None if value in (None, "", "(null)", "None") else value


def job_info_from_scontrol(text: str) -> JobInfo:
    """A :class:`JobInfo` from one job of ``scontrol show job -d`` (either layout)."""
    fields = parse_scontrol_show_job(text)
    by_node = parse_node_gres(text)
    uid_match = re.search(r"\((\d+)\)$", fields.get("UserId", ""))
    try:
        restarts = int(fields.get("Restarts", "0"))
    except ValueError:
        raise ValueError(f"Restarts={fields.get('Restarts')!r} is not a number") from None
    return JobInfo(
        job_id=fields["JobId"],
        state=fields.get("JobState", "UNKNOWN").upper(),
        restart_count=restarts,
        uid=int(uid_match.group(1)) if uid_match else None,
        partition=_null(fields.get("Partition")),
        reason=_null(fields.get("Reason")),
        gpus=_union(by_node),
        gpus_by_node=by_node,
        comment=_null(fields.get("Comment")),
        nodes=_null(fields.get("NodeList")),
        work_dir=_null(fields.get("WorkDir")),
        std_out=_null(fields.get("StdOut")),
        requeue={"1": True, "0": False}.get(fields.get("Requeue", "")),
        eligible_s=parse_slurm_time(fields.get("EligibleTime")),
    )


def _state_name(raw: Any) -> str:
    # 22.05 gives a string; later openapi versions give a list of flags
    if isinstance(raw, list):
        return str(raw[0]).upper() if raw else "UNKNOWN"
    return str(raw or "UNKNOWN").upper()


def _job_info_from_json(job: dict[str, Any]) -> JobInfo:
    nodes = str(job.get("nodes") or "")
    details = [str(d) for d in job.get("gres_detail") or []]
    by_node: dict[str, tuple[int, ...]] = {}
    if details and nodes:
        # one detail per node; a single-node job (spswap's case) names its node plainly
        key = nodes if len(details) == 1 else None
        for i, detail in enumerate(details):
            by_node[key or f"{nodes}#{i}"] = parse_gpu_indexes(detail)
    uid = job.get("user_id")
    return JobInfo(
        job_id=str(job["job_id"]),
        state=_state_name(job.get("job_state")),
        restart_count=int(job.get("restart_cnt") or 0),
        uid=int(uid) if isinstance(uid, int) else None,
        partition=_null(job.get("partition")),
        reason=_null(job.get("state_reason")),
        gpus=_union(by_node),
        gpus_by_node=by_node,
        comment=_null(job.get("comment")),
        nodes=_null(nodes),
        requeue=job["requeue"] if isinstance(job.get("requeue"), bool) else None,
        eligible_s=epoch_seconds(job.get("eligible_time")),
    )


def parse_squeue_json(text: str, job_id: str | None = None) -> list[JobInfo]:
    """Jobs in ``squeue --json`` output, only ``job_id`` if given (22.05 ignores ``-j``)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"squeue --json did not print JSON ({exc}): {text[:120]!r}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("jobs"), list):
        raise ValueError("squeue --json output has no 'jobs' list")
    errors = doc.get("errors") or []
    if errors:
        raise ValueError(f"squeue --json reported errors: {errors}")
    jobs = [_job_info_from_json(job) for job in doc["jobs"]]
    if job_id is not None:
        jobs = [job for job in jobs if job.job_id == str(job_id)]
    return jobs


def parse_kill_wait_s(config_text: str) -> float | None:
    """``KillWait`` from ``scontrol show config`` (``KillWait = 30 sec``): the seconds
    between a job's SIGTERM and its SIGKILL; None when the text has none."""
    for line in config_text.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip() == "KillWait":
            number = value.split()[0] if value.split() else ""
            try:
                return float(number)
            except ValueError:
                return None
    return None
