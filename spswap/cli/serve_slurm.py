"""``spswap serve``'s word with Slurm about its job: the requeue warning at the start, the
requeue asked at a preemption's end, and the job's facts its first run finds out and its
state directory remembers for the later runs (KillWait, the device, the Requeue flag)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from spswap.cli.common import err_console
from spswap.errors import SpswapError
from spswap.fsutil import atomic_write_bytes, make_private_dirs
from spswap.serve.checkpointer import REQUEUE_FILE, requeue_file_text
from spswap.slurm.backend import controller_up, get_backend, kill_wait_s
from spswap.slurm.requeue import requeue_warning


def controller_answers() -> bool:
    """Whether Slurm's controller answers ``scontrol ping`` (tens of ms either way, but a
    site with an unreachable backup controller waits for it: 5 s at most). The
    start's questions are worth asking only then: with the controller down, each other
    Slurm command retries its connection for seconds before it fails, and the start
    would wait for that twice over. (Its callers take it as ``answers``: one start asks
    once, through a cached one.)"""
    return shutil.which("scontrol") is not None and controller_up(timeout_s=5.0)


def warn_if_not_requeueable(job_id: str, state_dir: Path,
                            answers: Callable[[], bool] = controller_answers) -> None:  # fmt: skip
    """At the job's first run: say in the job log that a preemption would end this job
    for good, and write Slurm's Requeue flag into the state directory
    (:data:`~spswap.serve.checkpointer.REQUEUE_FILE`), where the run's stop reads it (a
    preemption of a job Slurm ends is not checkpointed). Slurm could not say: the run
    goes on as it would have, and its stop checkpoints."""
    path = state_dir / REQUEUE_FILE
    with contextlib.suppress(OSError):  # another job's, in a state directory given twice
        path.unlink(missing_ok=True)
    if not answers():
        return
    backend = get_backend(timeout_s=3.0)
    try:
        job = backend.job(job_id) if backend is not None else None
    except SpswapError:
        return
    if job is None or job.requeue is None:
        return
    if (warning := requeue_warning(job)) is not None:
        err_console.print(warning, markup=False, soft_wrap=True)
    _remember(path, requeue_file_text(job_id, job.requeue))


def requeue(job_id: str) -> None:
    """Ask Slurm to requeue ``job_id`` (a refusal is said, not raised)."""
    backend = get_backend()
    if backend is None:
        err_console.print("spswap serve: no Slurm commands here; not requeueing", markup=False)
        return
    try:
        backend.requeue(job_id)
    except SpswapError as e:
        # Preemption requeues the job by itself; a refused second request changes nothing.
        err_console.print(f"spswap serve: requeue request refused ({e})", markup=False)


DEVICE_FILE = "device"
KILL_WAIT_FILE = "kill_wait_s"


T = TypeVar("T", str, float)


def _remembered(state_dir: Path, name: str, parse: Callable[[str], T | None],
                find: Callable[[], T | None]) -> T | None:  # fmt: skip
    """A fact of the job that its first run finds out (``find``) and its state directory
    remembers in file ``name``, so later runs (a restore's start) need not find it again;
    None when it cannot be found (and nothing is written: asked again next run)."""
    path = state_dir / name
    try:
        saved = parse(path.read_text().strip())
        if saved is not None:
            return saved
    except (OSError, ValueError):
        pass
    value = find()
    if value is not None:
        _remember(path, f"{value}\n")
    return value


def _remember(path: Path, text: str) -> None:
    """Write a fact of the job into its state directory (``path``'s parent, made private
    first), best effort."""
    try:
        make_private_dirs(path.parent, os.getuid())
        atomic_write_bytes(path, text.encode(), mode=0o600)
    except (OSError, SpswapError):
        pass  # the run itself says what is wrong with the state directory


def job_kill_wait_s(state_dir: Path,
                    answers: Callable[[], bool] = controller_answers) -> float | None:  # fmt: skip
    """slurm.conf's KillWait, asked of Slurm by the job's first run."""

    def ask() -> float | None:
        return kill_wait_s(timeout_s=5.0) if answers() else None

    return _remembered(state_dir, KILL_WAIT_FILE, float, ask)


def job_device(state_dir: Path) -> str:
    """The device the job's first run chose: a later run names the same one in the
    identity it restores by, without importing torch (seconds on the restore's path)."""
    device = _remembered(state_dir, DEVICE_FILE, lambda s: s if s in ("cpu", "cuda") else None,
                         default_device)  # fmt: skip
    assert device is not None  # default_device always answers
    return device


def default_device() -> str:
    """ "cuda" where torch sees a GPU, else "cpu" (also without torch)."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"
