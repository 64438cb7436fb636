"""spswapd's start finishes the image deletions a dead daemon left undone: an image moved
aside after its restore (``.gone-``) whose freeing thread died with the daemon."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from spswap.checkpoint import criu, link_remap
from spswap.config import Config
from spswap.daemon import ckpt_recover, events, lifecycle
from spswap.daemon.state import DaemonState
from spswap.fsutil import atomic_write_json


def test_start_up_frees_what_a_dead_daemon_was_deleting(tmp_path: Path) -> None:
    cfg = Config.from_env({}, root=tmp_path / "root")
    lifecycle.prepare_dirs(cfg)
    st = DaemonState(cfg)
    shm = tmp_path / "shm"
    shm.mkdir()
    # died between the rename and the meta's unlink: the links are still its to discard
    gone = cfg.paths.images / f"{criu.GONE_PREFIX}job7-m-abc-1a2b3c4d"
    gone.mkdir(parents=True)
    (gone / "pages-1.img").write_bytes(b"\0" * 4096)
    parked = shm / f"{link_remap.PARKED_PREFIX}job7-m-abc-1"
    parked.write_text("sem")
    atomic_write_json(gone / criu.DUMP_META, {"link_remaps": [
        {"dir": str(shm), "name": "link_remap.1", "parked": parked.name}]})  # fmt: skip
    ckpt_recover.recover(st)
    assert not gone.exists() and not parked.exists()
    assert list(cfg.paths.images.iterdir()) == []


def test_start_up_says_which_kept_instances_the_last_daemon_left_ended(tmp_path: Path) -> None:
    """A restart ends the trees the last spswapd kept alive (its sweep takes their parked
    cgroups): each job's status no longer says kept, and a kept.ended event names the job
    and why (a newcomer walk saw only a parked_swept line with no job)."""
    cfg = Config.from_env({}, root=tmp_path / "root")
    lifecycle.prepare_dirs(cfg)
    st = DaemonState(cfg)
    st.statuses.write("761", state="saved", pid=4242, key="job761-x", kept=True)
    st.statuses.write("762", state="saved", pid=4243, key="job762-x", kept=False)
    ckpt_recover.recover(st)
    assert st.statuses.read("761")["kept"] is False
    ended = [e for e in events.tail(cfg.paths.events, 50) if e["kind"] == "kept.ended"]
    assert [(e["job_id"], e["detail"]["pid"]) for e in ended] == [("761", 4242)]
    assert ended[0]["detail"]["reason"].startswith("spswapd started again: the instance")


TRACER = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(15, sys.argv[2].encode())  # PR_SET_NAME: what /proc/PID/comm shows
if libc.ptrace(0x4206, int(sys.argv[1]), None, None) != 0:  # PTRACE_SEIZE
    sys.exit(f"seize: errno {ctypes.get_errno()}")
print("seized", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("name", ["criu", "gdb"])
def test_start_up_ends_a_dead_daemons_criu_that_still_holds_the_process(
    tmp_path: Path, name: str
) -> None:
    """A CRIU that outlived its daemon (it hung, or was orphaned) would hold the dumped
    process seized for good: the next daemon kills it, never another tracer."""
    target = subprocess.Popen(["sleep", "600"])
    tracer = subprocess.Popen([sys.executable, "-c", TRACER, str(target.pid), name],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert tracer.stdout is not None and tracer.stdout.readline() == "seized\n"
        ended = ckpt_recover.end_dead_daemons_criu(target.pid)
        if name == "criu":
            assert ended == tracer.pid
            assert tracer.wait(timeout=10) == -signal.SIGKILL
        else:
            assert ended is None and tracer.poll() is None
        assert ckpt_recover.end_dead_daemons_criu(os.getpid()) is None  # traced by none
    finally:
        for p in (tracer, target):
            p.kill()
            p.wait()
