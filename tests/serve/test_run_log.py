"""runs.jsonl: the exact line, a torn or foreign line skipped, mode 0600, no symlink
followed, and the process start time."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spswap.serve.run_log import (
    RUNS_FILE,
    RunPath,
    RunRecord,
    append_run,
    note_run,
    parse_runs,
    process_started_s,
    read_runs,
    run_line,
)  # fmt: skip

REC = RunRecord(restart_count=2, path=RunPath.KEPT, started_s=100.0, serving_s=101.5,
                pid=42, reason=None)  # fmt: skip


def test_line_exactly() -> None:
    assert run_line(REC) == ('{"path": "kept", "pid": 42, "reason": null, "restart_count": 2, '
                             '"serving_s": 101.5, "started_s": 100.0}\n')  # fmt: skip


def test_a_run_that_copied_from_the_pool_says_how_fast() -> None:
    rec = RunRecord(0, RunPath.POOL, 1.0, 2.0, 7, None, copy_gb_per_s=9.87654)
    assert run_line(rec) == ('{"copy_gb_per_s": 9.877, "path": "pool", "pid": 7, '
                             '"reason": null, "restart_count": 0, "serving_s": 2.0, '
                             '"started_s": 1.0}\n')  # fmt: skip
    assert parse_runs(run_line(rec))[0].copy_gb_per_s == 9.877


def test_round_trip_skips_a_foreign_line_and_stops_at_a_torn_one(tmp_path: Path) -> None:
    text = run_line(REC) + '{"other": 1}\n' + run_line(REC)[:-5]
    assert parse_runs(text) == [REC]
    append_run(tmp_path, REC)
    append_run(tmp_path, RunRecord(3, RunPath.IMAGE, 1.0, 2.0, 7, "x"))
    assert [r.path for r in read_runs(tmp_path)] == [RunPath.KEPT, RunPath.IMAGE]
    assert (tmp_path / RUNS_FILE).stat().st_mode & 0o777 == 0o600
    assert read_runs(tmp_path / "none") == []


def test_no_symlink_is_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("")
    (tmp_path / RUNS_FILE).symlink_to(target)
    with pytest.raises(OSError):
        append_run(tmp_path, REC)
    assert target.read_text() == ""
    # serving goes on: the failure is logged
    said: list[str] = []
    assert note_run(tmp_path, 0, RunPath.COLD, started_s=1.0, log=said.append) is None
    assert said and "could not add to" in said[0]


def test_process_start_time_is_when_the_process_started() -> None:
    before = time.time()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        started = process_started_s(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert before - 0.05 <= started <= time.time() + 0.05
    assert process_started_s() <= time.time()
    assert abs(process_started_s(os.getpid()) - process_started_s()) < 1e-6 + 0.02
