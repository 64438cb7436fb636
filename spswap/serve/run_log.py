"""``runs.jsonl`` in a job's state directory: one line per run of the job, saying how the
run came to serve (cold from disk, from the pool, restored kept or from an image) and
when: when the run's ``spswap serve`` process started and when it was serving.

The user reads it to see what each requeue cost (``spswap bench turns`` splits each turn
into Slurm's share and spswap's with it); it is the job's own record, in the user's
directory, written by the run itself. Plain files, no torch.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from spswap.liveness import pid_start_time

RUNS_FILE = "runs.jsonl"


class RunPath(str, Enum):
    """How a run came to serve."""

    COLD = "cold"  # the weights read from the model's files (and put in the pool)
    POOL = "pool"  # the weights from the pool, the engine started anew
    KEPT = "kept"  # the job's instance, kept alive (frozen) since its dump, thawed
    IMAGE = "image"  # the job's instance restored from its CRIU image


@dataclass(frozen=True)
class RunRecord:
    """One run of a job: which run, how it came up, and its times (epoch seconds)."""

    restart_count: int
    path: RunPath
    started_s: float  # this run's ``spswap serve`` process started
    serving_s: float  # it was serving (its front open, or the restore done)
    pid: int
    reason: str | None = None  # why it started cold, when a restore was expected
    copy_gb_per_s: float | None = None  # its weights' copy from the pool, when it made one
    # seconds from started_s to each step of the run's start (where its time goes)
    marks_s: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"restart_count": self.restart_count, "path": self.path.value,
               "started_s": round(self.started_s, 6), "serving_s": round(self.serving_s, 6),
               "pid": self.pid, "reason": self.reason}  # fmt: skip
        if self.copy_gb_per_s is not None:
            out["copy_gb_per_s"] = round(self.copy_gb_per_s, 3)
        if self.marks_s:
            out["marks_s"] = {k: round(v, 4) for k, v in self.marks_s.items()}
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RunRecord:
        return cls(restart_count=int(d["restart_count"]), path=RunPath(d["path"]),
                   started_s=float(d["started_s"]), serving_s=float(d["serving_s"]),
                   pid=int(d["pid"]), reason=d.get("reason"),
                   copy_gb_per_s=d.get("copy_gb_per_s"),
                   marks_s=d.get("marks_s") or None)  # fmt: skip


def run_line(record: RunRecord) -> str:
    """The record as one line of ``runs.jsonl`` (sorted keys: stable for tests)."""
    return json.dumps(record.to_json(), sort_keys=True) + "\n"


def parse_runs(text: str) -> list[RunRecord]:
    """Every whole, well-formed line of ``runs.jsonl``; a torn last line (a run killed
    while writing) or a foreign line is skipped, not fatal."""
    out: list[RunRecord] = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        try:
            out.append(RunRecord.from_json(json.loads(line)))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def read_runs(state_dir: Path) -> list[RunRecord]:
    """The job's runs, oldest first (empty when none has served yet)."""
    try:
        return parse_runs((state_dir / RUNS_FILE).read_text())
    except FileNotFoundError:
        return []


def append_run(state_dir: Path, record: RunRecord) -> None:
    """Add ``record``: one ``write`` of one line with O_APPEND (a line is never torn by a
    second writer), mode 0600 (the job's data is the user's alone), no symlink followed."""
    fd = os.open(state_dir / RUNS_FILE,
                 os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)  # fmt: skip
    try:
        os.write(fd, run_line(record).encode())
    finally:
        os.close(fd)


def process_started_s(pid: int | None = None) -> float:
    """When process ``pid`` (default: this one) started, in epoch seconds (to the kernel's
    clock tick, 10 ms): the run's start includes Python's own start-up, which is spswap's
    cost, not Slurm's. OSError when the process is gone."""
    pid = pid or os.getpid()
    start_ticks = pid_start_time(pid)
    if start_ticks is None:
        raise ProcessLookupError(f"process {pid} is gone")
    since_boot_s = start_ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot_s)


def note_run(state_dir: Path, restart_count: int, path: RunPath, *, started_s: float,
             reason: str | None = None, log: Any = print,
             copy_gb_per_s: float | None = None,
             marks_s: dict[str, float] | None = None) -> RunRecord | None:  # fmt: skip
    """Record that this run serves now (``started_s``: when its process started, see
    :func:`process_started_s`; ``marks_s``: epoch seconds of its steps, recorded as
    seconds after ``started_s``); a failure to write is logged, never fatal (the record
    is for the user's eyes and benchmarks, not for serving)."""
    try:
        marks = {k: v - started_s for k, v in (marks_s or {}).items()}
        record = RunRecord(restart_count=restart_count, path=path,
                           started_s=started_s, serving_s=time.time(),
                           pid=os.getpid(), reason=reason,
                           copy_gb_per_s=copy_gb_per_s, marks_s=marks or None)  # fmt: skip
        append_run(state_dir, record)
        return record
    except OSError as e:
        log(f"spswap serve: could not add to {state_dir / RUNS_FILE} ({e})")
        return None
