"""Running test code as a second real uid (root creates a system user for it), and the
short state roots such tests share with their daemon.

The second uid runs its part in a forked child that dropped root (setgid/setuid), so a
daemon sees a different SO_PEERCRED and the kernel applies real file permissions. A
fork, not a new interpreter: the venv's Python may live where that user cannot execute
it (/root/.pyenv), so everything the child needs must be imported before the fork.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spswap.checkpoint.criu import remove_image
from spswap.config import Config
from spswap.daemon import lifecycle

TEST_USER = "spswaptest1"


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


@contextmanager
def node_root(prefix: str, env: dict[str, str] | None = None) -> Iterator[Config]:
    """A short, world-traversable (0755) state root with its daemon stopped afterwards.

    Not under pytest's tmp_path: /tmp/pytest-of-root is 0700 (another uid could not reach
    the socket) and its paths come close to the 107-byte socket limit.
    """
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(root, 0o755)
    cfg = Config.from_env(env or {}, root=root)
    try:
        yield cfg
    finally:
        lifecycle.stop(cfg, timeout_s=5.0)
        # what the daemon left parked (kept trees, held cgroups, freeze holds) outlives it
        # and only a daemon of the same root would sweep it: this root is about to go (an
        # empty hold of a test root was left on the CI host by every run, 2026-12-07)
        from spswap.checkpoint.cgroups import root_tag, sweep

        sweep(root_tag(cfg.root))
        # an image left behind keeps links outside the root (link_remap: /dev/shm's) and
        # its dead tree's semaphore names: its job is over, as at a job's end for good
        images = cfg.paths.images
        for image in images.iterdir() if images.is_dir() else []:
            if image.is_dir():
                remove_image(image, tree_gone=True)
        shutil.rmtree(root, ignore_errors=True)
