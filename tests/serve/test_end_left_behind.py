"""What a dead instance left running is ended (a restored run that starts cold must not
share the GPU with an orphaned server), and the named semaphores its processes made do
not stay in /dev/shm: their resource tracker is spared the kill and cleans up."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from spswap.serve.checkpointer import end_left_behind, is_resource_tracker, process_tree
from tests.helpers.restore import running

# a Python started as vLLM's server starts its processes (spawn): one named semaphore,
# registered with its resource tracker (a child process)
HOLDER = """
import multiprocessing as mp, os, sys, time
sem = mp.get_context("spawn").Semaphore()
print(sem._semlock.name, flush=True)
time.sleep(600)
"""


def test_a_killed_tree_leaves_no_semaphore_name_behind() -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        name = holder.stdout.readline().strip()
        shm = Path("/dev/shm") / f"sem.{name.lstrip('/')}"
        assert shm.exists(), name
        deadline = time.monotonic() + 30
        while True:  # the tracker starts with the name (a fork, then its exec)
            tree = process_tree(holder.pid)
            trackers = [p for p, _ in tree if is_resource_tracker(_cmdline(p))]
            if trackers:
                break
            assert time.monotonic() < deadline, tree
            time.sleep(0.05)
        assert len(trackers) == 1 and len(tree) == 2, tree
        assert sorted(end_left_behind(tree)) == sorted(p for p, _ in tree)
        holder.wait(timeout=10)
        assert not running(trackers[0])
        assert not shm.exists(), f"{shm} left behind"
    finally:
        holder.kill()
        holder.wait()


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def test_a_resource_tracker_is_told_by_its_command_line() -> None:
    argv = [sys.executable, "-c", "from multiprocessing.resource_tracker import main;main(5)"]
    assert is_resource_tracker("\0".join(argv).encode() + b"\0")
    assert not is_resource_tracker(b"python3\0-m\0vllm.entrypoints.openai.api_server\0")
