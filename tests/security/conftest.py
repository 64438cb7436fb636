"""Fixtures: a root-owned temp root (0755), a real spswapd serving it, a real second uid.

The second uid runs its part in a forked child that dropped root (setgid/setuid), so
the daemon sees a different SO_PEERCRED and the kernel applies real file permissions.
"""

from __future__ import annotations

# The forked child runs as a uid that may not read the interpreter's own library
# directory (/root/.pyenv): anything it imports lazily is imported here first.
import concurrent.futures  # noqa: F401  (used lazily by spswap.pool.copy)
import json
import os
import pwd
import shutil
import subprocess
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import spswap.pool.importer  # noqa: F401
import spswap.pool.safetensors_format  # noqa: F401
import spswap.slots.gpus  # noqa: F401
from spswap.config import Config
from spswap.daemon import lifecycle

TEST_USER = "spswaptest1"
GPUS = "0,1"


@pytest.fixture
def cfg(monkeypatch: pytest.MonkeyPatch) -> Iterator[Config]:
    # Not under pytest's tmp_path: /tmp/pytest-of-root is 0700, so the other uid could
    # reach neither the socket nor the pool.
    root = Path(tempfile.mkdtemp(prefix="spsec-", dir="/tmp"))
    os.chmod(root, 0o755)
    monkeypatch.setenv("SPSWAP_GPUS", GPUS)  # the daemon inherits it
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    cfg = Config.from_env({"SPSWAP_GPUS": GPUS}, root=root)
    try:
        yield cfg
    finally:
        lifecycle.stop(cfg, timeout_s=5.0)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def daemon(cfg: Config) -> int:
    """The pid of a real spswapd (a detached subprocess, as root) serving ``cfg``'s root."""
    return lifecycle.start(cfg, wait_s=15.0)


@pytest.fixture(scope="session")
def user_uid() -> int:
    if os.geteuid() != 0:
        pytest.skip("needs root to create and switch to a second uid")
    try:
        return pwd.getpwnam(TEST_USER).pw_uid
    except KeyError:
        pass
    r = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        TEST_USER], capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"useradd {TEST_USER} failed: {r.stderr.strip()}")
    return pwd.getpwnam(TEST_USER).pw_uid


@dataclass
class Child:
    """A forked child running as another uid; :meth:`result` waits for its JSON answer."""

    pid: int
    rfd: int

    def result(self) -> Any:
        data = b""
        while chunk := os.read(self.rfd, 65536):
            data += chunk
        os.close(self.rfd)
        _, status = os.waitpid(self.pid, 0)
        out = json.loads(data) if data else {"crash": f"no output, status {status}"}
        assert "crash" not in out, out["crash"]
        return out["value"]


def spawn_as(uid: int, fn: Callable[..., Any], *args: Any) -> Child:
    """Run ``fn(*args)`` in a forked child as ``uid``; its JSON-able return value comes back.

    A fork, not a new interpreter: the venv's Python may live where the test user cannot
    execute it; everything the child needs is imported already.
    """
    gid = pwd.getpwuid(uid).pw_gid
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:
            os.close(rfd)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            assert os.getuid() == uid and os.geteuid() == uid
            out = {"value": fn(*args)}
            code = 0
        except BaseException:
            out = {"crash": traceback.format_exc()}
        finally:
            try:
                os.write(wfd, json.dumps(out).encode())
            finally:
                os._exit(code)
    os.close(wfd)
    return Child(pid, rfd)


def as_user(uid: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` run as ``uid``; waits for it."""
    return spawn_as(uid, fn, *args).result()


def outcome(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """``"ok"`` or ``"<ErrorType>: <message>"``, for results that cross the fork."""
    try:
        fn(*args, **kwargs)
        return "ok"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
