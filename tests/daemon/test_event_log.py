"""The event log's bound: spswapd starts a new file at its size limit, keeping one before;
readers (tail, follow) read across the two."""

from __future__ import annotations

import threading
from pathlib import Path

from spswap.daemon import events
from spswap.daemon.events import EventLog, rotated


def _kinds(path: Path) -> list[str]:
    return [e["kind"] for e in events.parse_lines(path.read_bytes())] if path.exists() else []


def test_a_full_log_starts_a_new_file_and_keeps_one_before(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, max_bytes=300)
    for i in range(12):
        log.append(f"e{i}", job_id=str(i))
    assert path.stat().st_size < 300 + 200  # at most one line past the limit
    assert rotated(path).exists() and rotated(path).stat().st_size >= 300
    kept = _kinds(rotated(path)) + _kinds(path)
    assert kept == [f"e{i}" for i in range(12 - len(kept), 12)], "newest kept, in order"
    assert len(kept) < 12, "the oldest file went"


def test_tail_reads_the_file_before_when_the_new_one_has_too_few(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, max_bytes=200)
    for i in range(6):
        log.append(f"e{i}")
    n_new = len(_kinds(path))
    assert 0 < n_new < 6
    assert [e["kind"] for e in events.tail(path, 6)] == [f"e{i}" for i in range(6)][-6:]
    assert [e["kind"] for e in events.tail(path, 1)] == ["e5"]
    assert events.tail(path, 0) == []
    assert events.tail(tmp_path / "none.jsonl", 5) == []


def test_follow_goes_on_into_the_new_file(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, max_bytes=400)  # one new file in the 8 (two would lose the middle)
    log.append("before")
    follower = events.follow(path, poll_s=0.01)  # from the end, now
    for i in range(8):  # past the limit: a new file starts on the way
        log.append(f"e{i}")
    assert rotated(path).exists()
    assert [next(follower)["kind"] for _ in range(8)] == [f"e{i}" for i in range(8)]


def test_threads_appending_at_once_lose_nothing_in_the_two_files(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, max_bytes=40 * 1024)

    def write(t: int) -> None:
        for i in range(100):
            log.append("x", job_id=f"{t}-{i}")

    threads = [threading.Thread(target=write, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = events.parse_lines(rotated(path).read_bytes() if rotated(path).exists() else b"")
    lines += events.parse_lines(path.read_bytes())
    # 800 events of ~75 bytes: more than one file, less than two
    assert rotated(path).exists()
    assert len(lines) == 800 and len({e["job_id"] for e in lines}) == 800
