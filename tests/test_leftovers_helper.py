"""The tests' sweep of what they left under their root finds a process in its own
session that is nobody's child (as a restored instance is) and ends it, and leaves
processes of other roots alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.leftovers import end_all_under, pids_under


def _sleeper(root: Path) -> subprocess.Popen:
    env = {**os.environ, "SPSWAP_ROOT": str(root)}
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env,
                            start_new_session=True)  # fmt: skip


def test_a_process_of_the_root_is_found_and_ended_and_others_are_not(tmp_path: Path) -> None:
    mine, other = tmp_path / "mine", tmp_path / "other"
    a, b = _sleeper(mine), _sleeper(other)
    try:
        assert a.pid in pids_under(mine)
        assert b.pid not in pids_under(mine)
        assert a.pid in end_all_under(mine)
        assert a.wait(timeout=10) == -9
        time.sleep(0.1)
        assert b.poll() is None
    finally:
        for p in (a, b):
            p.kill()
            p.wait()
