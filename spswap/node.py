"""The node side of a Slurm job: what ``spswap node prolog`` and ``node epilog`` do.

Both run as root from slurmd with almost no environment. A failing prolog drains the
node, so spswap's own trouble (daemon down, bad settings, a full tmpfs) is logged to
``$SPSWAP_ROOT/log/{prolog,epilog}.log`` and never turned into a non-zero exit. Only a
call outside any Slurm job (no ``SLURM_JOB_ID``) is an error, since that is a mistake
of whoever ran it, not a node problem.

This module is on the prolog's hot path (budget: 100 ms including Python start-up):
it imports only the config, the daemon client and lifecycle, and the Slurm env reader.
The console script (:mod:`spswap.cli.main`) calls it before loading typer or rich.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from spswap.config import DEFAULT_ROOT, Config
from spswap.errors import SpswapError

NOT_IN_SLURM = (
    "error: no SLURM_JOB_ID in the environment: `spswap node {action}` is run by slurmd "
    "as the Slurm {Action} (slurm.conf: {Action}=/path/to/{action}.sh), not by hand"
)


FALLBACK_LOG_DIR = Path("/var/log")


def log_dir_for(root: Path) -> Path:
    """Where the hooks log: ``root/log`` when it and the root are this user's own (not a
    symlink, writable by no one else), made if absent; else :data:`FALLBACK_LOG_DIR`
    (files ``spswap-<action>.log``). On /dev/shm any user can make the root, and a symlink
    for the log in it, before spswapd does: root must not write through what they made."""
    from spswap.daemon.trust import unsafe_dir

    uid = os.geteuid()

    def own(path: Path) -> bool:
        return path.is_dir() and unsafe_dir(path, uid) is None

    if unsafe_dir(root, uid) is None:  # this user's, or not there yet
        try:
            (root / "log").mkdir(parents=True, exist_ok=True)
        except OSError:
            pass
        if own(root) and own(root / "log"):  # (again: someone may have made it meanwhile)
            return root / "log"
    return FALLBACK_LOG_DIR


def _log(root: Path, action: str, message: str) -> None:
    """Append one line to ``log/<action>.log`` (see :func:`log_dir_for`); a log that can't
    be written is ignored."""
    line = f"{time.strftime('%F %T')} [{os.getpid()}] {action}: {message}\n"
    try:
        log_dir = log_dir_for(root)
        name = f"{action}.log" if log_dir != FALLBACK_LOG_DIR else f"spswap-{action}.log"
        fd = os.open(log_dir / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                     0o644)  # fmt: skip
        try:
            os.write(fd, line.encode(errors="replace"))
        finally:
            os.close(fd)
    except OSError:
        pass


def _config(env: Mapping[str, str], action: str, *, read_file: bool) -> Config | None:
    """The hook's settings: the settings file's (which hook.sh sourced already), then the
    environment's; an ``env`` a caller hands in (the tests) is taken alone."""
    try:
        return Config.load(env) if read_file else Config.from_env(env)
    except SpswapError as e:
        _log(Path(env.get("SPSWAP_ROOT") or DEFAULT_ROOT), action, f"bad settings: {e}")
        return None


def _hook(action: str, env: Mapping[str, str] | None, body: Callable[[Config, Any], None]
          ) -> int:  # fmt: skip
    """Run ``body(cfg, job)`` for a Slurm hook: 0 whatever goes wrong on spswap's side
    (logged to ``log/<action>.log``: a failing hook drains the node), 2 only outside a job."""
    from spswap.slurm.env import JobEnv

    read_file = env is None
    env = os.environ if env is None else env
    job = JobEnv.from_env(env)
    if job is None:
        print(NOT_IN_SLURM.format(action=action, Action=action.capitalize()), file=sys.stderr)
        return 2
    cfg = _config(env, action, read_file=read_file)
    if cfg is None:
        return 0
    try:
        body(cfg, job)
    except SpswapError as e:
        _log(cfg.root, action, f"job {job.job_id}: {e}")
    except Exception:
        _log(cfg.root, action, f"job {job.job_id}: unexpected error\n{traceback.format_exc()}")
    return 0


def prolog(env: Mapping[str, str] | None = None) -> int:
    """Ensure spswapd runs and record the job (id, uid, user, GPUs, restart count).

    Returns 0 whatever goes wrong on spswap's side (logged to ``log/prolog.log``);
    2 only outside a Slurm job.
    """

    def body(cfg: Config, job: Any) -> None:
        from spswap.daemon import lifecycle
        from spswap.daemon.client import Client

        if job.uid is None:
            raise SpswapError("no SLURM_JOB_UID in the prolog's environment; job not recorded")
        lifecycle.ensure(cfg)
        Client(cfg, timeout_s=10.0).call(
            "job.register", job_id=job.job_id, uid=job.uid, user=job.user or "",
            gpus=list(job.gpus), restart_count=job.restart_count,
            **({"node": job.node} if job.node else {}),
        )  # fmt: skip

    return _hook("prolog", env, body)


def epilog(env: Mapping[str, str] | None = None) -> int:
    """Release what the job held (slots, pool uses); keep the pool and the images.

    Returns 0 whatever goes wrong on spswap's side (logged to ``log/epilog.log``);
    2 only outside a Slurm job.
    """

    def body(cfg: Config, job: Any) -> None:
        from spswap.daemon.client import Client

        result = Client(cfg, timeout_s=30.0).call("job.end", job_id=job.job_id)
        for problem in result.get("problems", []):
            _log(cfg.root, "epilog", f"job {job.job_id}: {problem}")

    return _hook("epilog", env, body)
