"""Fixtures: a root-owned temp root (0755), a real spswapd serving it, a real second uid.

The second uid runs its part in a forked child that dropped root (setgid/setuid), so
the daemon sees a different SO_PEERCRED and the kernel applies real file permissions.
"""

from __future__ import annotations

# The forked child runs as a uid that may not read the interpreter's own library
# directory (/root/.pyenv): anything it imports lazily is imported here first.
import concurrent.futures  # noqa: F401  (used lazily by spswap.pool.copy)
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import spswap.pool.importer  # noqa: F401
import spswap.pool.safetensors_format  # noqa: F401
import spswap.slots.gpus  # noqa: F401
from spswap.checkpoint import cgroup_paths
from spswap.config import Config
from spswap.daemon import lifecycle
from tests.uids import TEST_USER, as_user, node_root, spawn_as  # noqa: F401 (re-exported)

GPUS = "0,1"
JOB = "424242"  # the job of job_cgroup (a stand-in for Slurm's)
OTHER_USER = "spswaptest2"


@pytest.fixture
def cfg(monkeypatch: pytest.MonkeyPatch) -> Iterator[Config]:
    monkeypatch.setenv("SPSWAP_GPUS", GPUS)  # the daemon inherits it
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with node_root("spsec-", {"SPSWAP_GPUS": GPUS}) as cfg:
        yield cfg


@pytest.fixture(scope="session")
def other_uid(user_uid: int) -> int:
    """A third real uid (neither root nor ``user_uid``): the user another one attacks."""
    import pwd
    import subprocess

    try:
        return pwd.getpwnam(OTHER_USER).pw_uid
    except KeyError:
        pass
    r = subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", OTHER_USER],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"useradd {OTHER_USER} failed: {r.stderr.strip()}")
    return pwd.getpwnam(OTHER_USER).pw_uid


@pytest.fixture
def daemon(cfg: Config) -> int:
    """The pid of a real spswapd (a detached subprocess, as root) serving ``cfg``'s root."""
    return lifecycle.start(cfg, wait_s=15.0)


def outcome(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """``"ok"`` or ``"<ErrorType>: <message>"``, for results that cross the fork."""
    try:
        fn(*args, **kwargs)
        return "ok"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


@pytest.fixture
def job_cgroup() -> Iterator[Path]:
    """``job_<JOB>`` in the cgroup v2 hierarchy, two levels down as Slurm's are."""
    v2 = [m for m in cgroup_paths.mounts() if m.controllers == ""]
    if not v2:
        pytest.skip("no cgroup v2 hierarchy here")
    top = Path(v2[0].mountpoint) / f"spswap-test-{uuid.uuid4().hex[:8]}"
    try:
        (top / f"job_{JOB}").mkdir(parents=True)
    except OSError as e:
        pytest.skip(f"cannot make a cgroup here: {e}")
    yield top / f"job_{JOB}"
    _remove_cgroups(top / f"job_{JOB}", top)


def _remove_cgroups(*dirs: Path) -> None:
    """Remove each (emptied of processes a moment ago: retried while the kernel lets go)."""
    for d in dirs:
        for _ in range(50):
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.1)
