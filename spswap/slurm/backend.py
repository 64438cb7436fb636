"""The Slurm controller, behind one interface: query, requeue, signal, cancel.

Two backends with the same methods: :class:`PyslurmBackend` where ``import pyslurm``
works and matches the installed Slurm's major.minor version (pyslurm refuses any
other), :class:`CliBackend` (scontrol/squeue/scancel) everywhere else.
:func:`get_backend` picks one. Nothing is cached: every answer comes from the
controller at the time of the call.

:meth:`SlurmBackend.job_alive` is the :data:`spswap.liveness.JobProbe` the slot table
and the pool plug in. It answers None when it cannot tell (controller unreachable,
command missing): callers must never reclaim on None.
"""

from __future__ import annotations

import os
import re
import shutil
import signal as signal_module
import subprocess
import time
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from spswap.errors import SlurmCommandError, SpswapError
from spswap.liveness import JobProbe
from spswap.slurm.parse import (
    JobInfo,
    epoch_seconds,
    job_info_from_scontrol,
    parse_kill_wait_s,
    parse_squeue_json,
)
from spswap.slurm.requeue import requeue_refusal

CLI_COMMANDS = ("scontrol", "squeue", "scancel")
DEFAULT_TIMEOUT_S = 10.0
# what scontrol/pyslurm say for a job the controller no longer knows (purged after MinJobAge)
_INVALID_JOB = "Invalid job id specified"
_ESLURM_INVALID_JOB_ID = 2017


@runtime_checkable
class SlurmBackend(Protocol):
    """What spswap asks of Slurm. Job ids are strings (``"123"``, ``"123_4"``)."""

    name: str

    def available(self) -> bool:
        """True when this backend can reach Slurm's commands or library."""
        ...

    def job(self, job_id: str) -> JobInfo | None:
        """The job as the controller sees it; None when the controller does not know it."""
        ...

    def job_alive(self, job_id: str) -> bool | None:
        """True while the job holds its allocation; False once ended or unknown;
        None when the controller cannot be asked (never reclaim on None)."""
        ...

    def jobs(self) -> list[JobInfo]:
        """Every job the controller knows."""
        ...

    def requeue(self, job_id: str) -> None:
        """Requeue the job (it reruns with restart count + 1)."""
        ...

    def signal_batch(self, job_id: str, signal: str | int) -> None:
        """Send ``signal`` (``"USR1"``, ``"SIGUSR1"`` or a number) to the batch shell."""
        ...

    def cancel(self, job_id: str) -> None:
        """Cancel the job."""
        ...


def slurm_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of spswap's Slurm commands: the caller's, with times in Slurm's
    standard form (``2026-12-04T02:33:28``, what :func:`~spswap.slurm.parse.parse_slurm_time`
    reads) whatever ``SLURM_TIME_FORMAT`` the user set."""
    return {**environ, "SLURM_TIME_FORMAT": "standard"}


def signal_name(signal: str | int) -> str:
    """``"SIGUSR1"``, ``"usr1"``, ``10`` -> ``"USR1"``; ValueError for an unknown signal."""
    try:
        if isinstance(signal, int) or signal.isdigit():
            return signal_module.Signals(int(signal)).name.removeprefix("SIG")
        name = signal.upper().removeprefix("SIG")
        return signal_module.Signals["SIG" + name].name.removeprefix("SIG")
    except (KeyError, ValueError):
        raise ValueError(f"unknown signal {signal!r}: use a name such as USR1 or TERM") from None


def _liveness(backend: SlurmBackend, job_id: str) -> bool | None:
    try:
        info = backend.job(job_id)
    except SlurmCommandError:
        return None
    return False if info is None else info.allocated


class CliBackend:
    """Slurm through ``scontrol``, ``squeue`` and ``scancel`` subprocesses."""

    name = "cli"

    def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s

    def available(self) -> bool:
        return all(shutil.which(cmd) for cmd in CLI_COMMANDS)

    def _run(self, argv: Sequence[str], *, ok_if: str | None = None) -> str | None:
        """stdout of ``argv``; None when it failed with ``ok_if`` in its output."""
        argv = list(argv)
        try:
            # times as parse_slurm_time reads them, whatever the user's SLURM_TIME_FORMAT
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s,
                                  check=False, env=slurm_env(os.environ))  # fmt: skip
        except FileNotFoundError:
            raise SlurmCommandError(
                f"{argv[0]} not found: install Slurm's client commands (Debian: slurm-client) "
                "or put them on PATH",
                argv=argv,
            ) from None
        except subprocess.TimeoutExpired as exc:
            raise SlurmCommandError(
                f"`{' '.join(argv)}` did not answer within {self.timeout_s:g} s: is slurmctld "
                "up? check with `scontrol ping`",
                argv=argv, output=str(exc.output or ""),
            ) from None  # fmt: skip
        output = (proc.stdout or "") + (proc.stderr or "")
        if proc.returncode != 0:
            if ok_if is not None and ok_if in output:
                return None
            raise SlurmCommandError(
                f"`{' '.join(argv)}` failed (exit {proc.returncode}): {output.strip()[:500]}\n"
                "check the job id, your rights on the job, and `scontrol ping`",
                argv=argv, output=output,
            )  # fmt: skip
        return proc.stdout

    def job(self, job_id: str) -> JobInfo | None:
        # the multi-line layout keeps user-controlled names on lines of their own
        argv = ["scontrol", "show", "job", "-d", str(job_id)]
        text = self._run(argv, ok_if=_INVALID_JOB)
        if text is None:
            return None
        try:
            return job_info_from_scontrol(text)
        except (ValueError, KeyError) as exc:
            raise SlurmCommandError(
                f"cannot read the output of `{' '.join(argv)}`: {exc}; is this Slurm 22.05+?",
                argv=argv, output=text,
            ) from None  # fmt: skip

    def job_alive(self, job_id: str) -> bool | None:
        return _liveness(self, job_id)

    def jobs(self) -> list[JobInfo]:
        argv = ["squeue", "--json"]
        text = self._run(argv) or ""
        try:
            return parse_squeue_json(text)
        except ValueError as exc:
            raise SlurmCommandError(
                f"cannot read the output of `squeue --json`: {exc}", argv=argv, output=text
            ) from None

    def requeue(self, job_id: str) -> None:
        try:
            self._run(["scontrol", "requeue", str(job_id)])
        except SlurmCommandError as e:
            if (why := requeue_refusal(job_id, e.output)) is None:
                raise
            raise SlurmCommandError(why, argv=e.argv, output=e.output) from None

    def signal_batch(self, job_id: str, signal: str | int) -> None:
        # without --batch the signal goes to the job's steps, not to the batch shell
        self._run(["scancel", "--batch", f"--signal={signal_name(signal)}", str(job_id)])

    def cancel(self, job_id: str) -> None:
        self._run(["scancel", str(job_id)])


def parse_version(text: str) -> tuple[int, int] | None:
    """Major and minor of ``"slurm 22.05.8"``, ``"22.5.1"`` or ``"slurm-wlm 22.05.8"``."""
    match = re.search(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def installed_slurm_version(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int] | None:
    """The installed Slurm's (major, minor) from ``scontrol --version``; None if absent."""
    if shutil.which("scontrol") is None:
        return None
    try:
        proc = subprocess.run(
            ["scontrol", "--version"], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_version(proc.stdout) if proc.returncode == 0 else None


class PyslurmBackend:
    """Slurm through pyslurm (22.5+ API: ``Job.load``, ``Job(id).requeue()``...).

    ``module`` is the imported pyslurm. It must match the installed Slurm's major.minor:
    use :meth:`create`, which checks. GPU indexes are not read through pyslurm
    (``JobInfo.gpus`` stays empty); ask :class:`CliBackend` or the job environment.
    """

    name = "pyslurm"

    def __init__(self, module: ModuleType | Any) -> None:
        self.pyslurm = module

    @classmethod
    def create(cls, slurm_version: tuple[int, int] | None) -> PyslurmBackend | None:
        """The backend when pyslurm imports and matches ``slurm_version``; else None."""
        try:
            import pyslurm  # type: ignore[import-not-found]
        except Exception:  # a pyslurm built for another libslurm fails in odd ways
            return None
        return cls.if_matching(pyslurm, slurm_version)

    @classmethod
    def if_matching(
        cls, module: ModuleType | Any, slurm_version: tuple[int, int] | None
    ) -> PyslurmBackend | None:
        """The backend over ``module`` when its version matches ``slurm_version``."""
        version = parse_version(str(getattr(module, "__version__", "")))
        if version is None or slurm_version is None or version != slurm_version:
            return None
        return cls(module)

    def available(self) -> bool:
        return True

    def _job_number(self, job_id: str) -> int:
        if not str(job_id).isdigit():
            raise SlurmCommandError(
                f"pyslurm takes numeric job ids, got {job_id!r}: pass the raw id "
                "($SLURM_JOB_ID), not an array id like 123_4",
                argv=["pyslurm", str(job_id)],
            )
        return int(job_id)

    def _call(self, what: str, job_id: str, fn: Any) -> Any:
        try:
            return fn()
        except SlurmCommandError:
            raise
        except Exception as exc:
            if getattr(exc, "errno", None) == _ESLURM_INVALID_JOB_ID or _INVALID_JOB in str(exc):
                raise _UnknownJob from exc
            raise SlurmCommandError(
                f"pyslurm {what} of job {job_id} failed: {exc}; check `scontrol ping` and "
                "your rights on the job",
                argv=["pyslurm", what, str(job_id)], output=str(exc),
            ) from exc  # fmt: skip

    def job(self, job_id: str) -> JobInfo | None:
        number = self._job_number(job_id)
        try:
            job = self._call("Job.load", job_id, lambda: self.pyslurm.Job.load(number))
        except _UnknownJob:
            return None
        uid = getattr(job, "user_id", None)
        return JobInfo(
            job_id=str(job.id),
            state=str(job.state).upper(),
            restart_count=int(getattr(job, "requeue_count", 0) or 0),
            uid=int(uid) if uid is not None else None,
            partition=getattr(job, "partition", None) or None,
            reason=getattr(job, "state_reason", None) or None,
            comment=getattr(job, "comment", None) or None,
            nodes=getattr(job, "nodes", None) or None,
            requeue=requeue if isinstance(requeue := getattr(job, "requeue", None), bool) else None,
            eligible_s=epoch_seconds(getattr(job, "eligible_time", None)),
        )

    def job_alive(self, job_id: str) -> bool | None:
        return _liveness(self, job_id)

    def jobs(self) -> list[JobInfo]:
        loaded = self._call("Jobs.load", "*", lambda: self.pyslurm.Jobs.load())
        return [info for jid in list(loaded.keys()) if (info := self.job(str(jid)))]

    def requeue(self, job_id: str) -> None:
        number = self._job_number(job_id)
        self._call("requeue", job_id, lambda: self.pyslurm.Job(number).requeue())

    def signal_batch(self, job_id: str, signal: str | int) -> None:
        number = self._job_number(job_id)
        signum = int(signal_module.Signals["SIG" + signal_name(signal)])
        self._call(
            "send_signal", job_id,
            lambda: self.pyslurm.Job(number).send_signal(signum, steps="batch"),
        )  # fmt: skip

    def cancel(self, job_id: str) -> None:
        number = self._job_number(job_id)
        self._call("cancel", job_id, lambda: self.pyslurm.Job(number).cancel())


class _UnknownJob(Exception):
    """Internal: pyslurm said the controller does not know the job."""


def kill_wait_s(*, timeout_s: float = DEFAULT_TIMEOUT_S) -> float | None:
    """slurm.conf's KillWait as the controller has it; None when Slurm cannot be asked."""
    cli = CliBackend(timeout_s=timeout_s)
    if not shutil.which("scontrol"):
        return None
    try:
        return parse_kill_wait_s(cli._run(["scontrol", "show", "config"]) or "")
    except SlurmCommandError:
        return None


def get_backend(*, timeout_s: float = DEFAULT_TIMEOUT_S) -> SlurmBackend | None:
    """pyslurm when a matching one imports, else the CLI; None when Slurm is absent."""
    cli = CliBackend(timeout_s=timeout_s)
    if not cli.available():
        return None
    pyslurm_backend = PyslurmBackend.create(installed_slurm_version(timeout_s))
    return pyslurm_backend if pyslurm_backend is not None else cli


PROBE_CACHE_S = 5.0  # a job's verdict is reused this long (probes run under file locks)
PING_RETRY_S = 60.0  # after finding the controller down, ask it again only this late


def controller_up(timeout_s: float = 5.0) -> bool:
    """``scontrol ping`` says the primary controller is UP."""
    try:
        out = subprocess.run(["scontrol", "ping"], capture_output=True, text=True,
                             timeout=timeout_s)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and " is UP" in out.stdout


def job_probe(*, timeout_s: float = DEFAULT_TIMEOUT_S) -> JobProbe | None:
    """The probe bookkeeping plugs in for job-bound holders (``liveness.JobProbe``):
    None where Slurm is absent (holders are then judged by their processes alone).

    Nothing is asked until the first probe (most commands never need one): then the
    controller is pinged once (a dead one makes every Slurm command wait for its timeout;
    the probe answers "cannot tell" and pings again a minute later), and each job's
    verdict is kept for a few seconds.
    """
    if not CliBackend(timeout_s=timeout_s).available():
        return None
    backend: list[SlurmBackend | None] = []
    down_since: list[float] = []
    cache: dict[str, tuple[float, bool | None]] = {}

    def probe(job_id: str) -> bool | None:
        now = time.monotonic()
        hit = cache.get(job_id)
        if hit is not None and now - hit[0] < PROBE_CACHE_S:
            return hit[1]
        if down_since and now - down_since[0] < PING_RETRY_S:
            return None
        if not backend:
            if not controller_up(min(timeout_s, 5.0)):
                down_since[:] = [now]
                return None
            down_since.clear()
            try:
                backend.append(get_backend(timeout_s=timeout_s))
            except SpswapError:
                backend.append(None)
        verdict = None if backend[0] is None else backend[0].job_alive(job_id)
        cache[job_id] = (now, verdict)
        return verdict

    return probe
