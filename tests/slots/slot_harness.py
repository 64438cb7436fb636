"""Runs slot_worker.py processes and checks their grant log (shared by the slot tests)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("slot_worker.py")


def read_log(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    # Only whole lines: a worker's line being appended while we poll can be seen half
    # written (a read is not atomic with a concurrent write); every line ends in "\n".
    complete = log.read_text().split("\n")[:-1]
    return [json.loads(line) for line in complete if line.strip()]


def start_worker(
    slots_dir: Path,
    gpus: list[int],
    log: Path,
    name: str,
    ops: list[dict],
    *,
    hold_last_forever: bool = False,
    timeout_s: float = 60.0,
) -> subprocess.Popen:
    plan = {
        "dir": str(slots_dir), "gpus": gpus, "log": str(log), "name": name, "ops": ops,
        "hold_last_forever": hold_last_forever, "timeout_s": timeout_s, "poll_s": 0.005,
    }  # fmt: skip
    return subprocess.Popen(
        [sys.executable, str(WORKER), json.dumps(plan)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def wait_for(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.005)


def kill_and_log(proc: subprocess.Popen, log: Path, name: str) -> None:
    """SIGKILL a worker and log the moment just before the kill as its grant's end.

    Every logged interval must lie inside the true one (a grant logged after the table
    granted it, a release logged before the table is told): the holder surely lived
    until the kill was sent, so that time is a lower bound on its end. (The time after
    the reap is not: another worker may be granted the unit between the death and that
    moment, which would look like a double grant that never happened.)
    """
    t = time.monotonic_ns()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps({"ev": "killed", "w": name, "t": t}) + "\n").encode())
    finally:
        os.close(fd)


def run_scenario(slots_dir: Path, gpus: list[int], log: Path, workers: list[dict],
                 *, timeout_s: float = 60.0) -> list[dict[str, Any]]:  # fmt: skip
    """Start every worker at once; kill those marked ``kill`` once they hold their last grant."""
    procs = {}
    for i, w in enumerate(workers):
        name = f"w{i}"
        procs[name] = (start_worker(slots_dir, gpus, log, name, w["ops"],
                                    hold_last_forever=w.get("kill", False)), w)  # fmt: skip
    deadline = time.monotonic() + timeout_s
    try:
        # Kill each marked worker as soon as it holds its last grant, in whatever order
        # that happens (the others may be queued behind it), until every worker is done.
        pending = set(procs)
        while pending:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"workers {sorted(pending)} did not finish in {timeout_s} s; "
                    f"log: {read_log(log)}"
                )
            holding = {e["w"] for e in read_log(log) if e["ev"] == "grant" and e["final"]}
            for name in sorted(pending):
                proc, w = procs[name]
                if w.get("kill") and name in holding:
                    kill_and_log(proc, log, name)
                    pending.discard(name)
                elif not w.get("kill") and proc.poll() is not None:
                    _out, err = proc.communicate()
                    assert proc.returncode == 0, f"worker {name} failed:\n{err}"
                    pending.discard(name)
                elif w.get("kill") and proc.poll() is not None:
                    _out, err = proc.communicate()
                    raise AssertionError(f"worker {name} exited before it was killed:\n{err}")
            time.sleep(0.005)
    finally:
        for proc, _w in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return read_log(log)


def intervals(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per grant: its keys, ticket, candidates, logged start and end."""
    ends: dict[str, int] = {}
    killed_at = {e["w"]: e["t"] for e in events if e["ev"] == "killed"}
    for e in events:
        if e["ev"] == "release":
            ends[e["rid"]] = e["t"]
    out = []
    for e in events:
        if e["ev"] != "grant":
            continue
        end = ends.get(e["rid"], killed_at.get(e["w"]))
        assert end is not None, f"grant {e['rid']} of {e['w']} was neither released nor killed"
        out.append({**e, "start": e["t"], "end": end})
    return out


def check_no_double_grant(events: list[dict[str, Any]]) -> None:
    """No (gpu, unit) is in two grants whose logged intervals overlap."""
    by_key: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for iv in intervals(events):
        for g, u in iv["keys"]:
            by_key.setdefault((g, u), []).append(iv)
    for key, ivs in by_key.items():
        ivs.sort(key=lambda iv: iv["start"])
        for a, b in zip(ivs, ivs[1:], strict=False):
            assert b["start"] >= a["end"], (
                f"GPU {key[0]} unit {key[1]} granted twice at once: {a['rid']} ({a['w']}) "
                f"until {a['end']} and {b['rid']} ({b['w']}) from {b['start']}"
            )


def check_fifo(events: list[dict[str, Any]]) -> None:
    """Requests that share a GPU are granted in ticket order."""
    grants = [e for e in events if e["ev"] == "grant"]
    for a in grants:
        for b in grants:
            if a["ticket"] < b["ticket"] and set(a["cands"]) & set(b["cands"]):
                assert a["granted_at"] < b["granted_at"], (
                    f"ticket {b['ticket']} ({b['w']}) was granted before earlier ticket "
                    f"{a['ticket']} ({a['w']}) on shared GPUs {set(a['cands']) & set(b['cands'])}"
                )
