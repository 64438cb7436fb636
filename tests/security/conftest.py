"""Fixtures: a root-owned temp root (0755), a real spswapd serving it, a real second uid.

The second uid runs its part in a forked child that dropped root (setgid/setuid), so
the daemon sees a different SO_PEERCRED and the kernel applies real file permissions.
"""

from __future__ import annotations

# The forked child runs as a uid that may not read the interpreter's own library
# directory (/root/.pyenv): anything it imports lazily is imported here first.
import concurrent.futures  # noqa: F401  (used lazily by spswap.pool.copy)
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import spswap.pool.importer  # noqa: F401
import spswap.pool.safetensors_format  # noqa: F401
import spswap.slots.gpus  # noqa: F401
from spswap.config import Config
from spswap.daemon import lifecycle
from tests.uids import TEST_USER, as_user, node_root, spawn_as  # noqa: F401 (re-exported)

GPUS = "0,1"
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
