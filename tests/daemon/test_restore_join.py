"""A restored instance joins the run that asked for it, or is ended (ckpt_restore._into_job)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spswap.config import Config
from spswap.daemon import lifecycle
from spswap.daemon.ckpt_restore import Asker, _into_job
from spswap.daemon.state import DaemonState
from spswap.errors import CheckpointFailed
from tests.checkpoint.test_cgroups import _running

TREE = """
import os, time
if os.fork() == 0:
    time.sleep(300)
    os._exit(0)
time.sleep(300)
"""


def _tree() -> tuple[subprocess.Popen, list[int]]:
    from spswap.checkpoint.proctree import process_tree_pids

    proc = subprocess.Popen([sys.executable, "-c", TREE])
    deadline = time.monotonic() + 10
    while len(pids := process_tree_pids(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(pids) == 2
    return proc, pids


def test_an_instance_whose_run_is_gone_is_ended_not_left_outside_any_job(
    tmp_path: Path,
) -> None:
    cfg = Config.from_env({}, root=tmp_path / "root")
    lifecycle.prepare_dirs(cfg)
    st = DaemonState(cfg)
    gone = subprocess.Popen(["true"])
    gone.wait()
    proc, pids = _tree()
    try:
        with pytest.raises(CheckpointFailed, match="ended before its instance could join it"):
            _into_job(st, "7", proc.pid, Asker.of(gone.pid))
        assert not any(_running(p) for p in pids)
    finally:
        proc.kill()
    # its pid in use again by another process (here: this one, with another start time):
    # that is not the run that asked, and the tree never joins the new process's cgroups
    me = Asker.of(os.getpid())
    assert me.start is not None
    proc, pids = _tree()
    try:
        with pytest.raises(CheckpointFailed, match="ended before its instance could join it"):
            _into_job(st, "7", proc.pid, Asker(me.pid, me.start - 1, me.cgroups))
        assert not any(_running(p) for p in pids)
    finally:
        proc.kill()
    # a run that is there keeps its instance (joined, or in its cgroups already)
    proc, pids = _tree()
    try:
        _into_job(st, "7", proc.pid, Asker.of(os.getpid()))
        assert all(_running(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
