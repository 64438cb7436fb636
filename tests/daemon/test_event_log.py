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


def test_a_long_event_is_cut_to_its_bound() -> None:
    event = events.make_event("slots.reserve", uid=5, ts=1.0, model="m" * 5000, units=[1, 2])
    line = events.bounded_line(event, max_bytes=600)
    assert line == (
        b'{"detail":{"cut_from_bytes":5092,"model":"' + b"m" * 256 + b'... (cut)","units":'
        b'[1,2]},"job_id":null,"kind":"slots.reserve","ts":1.0,"uid":5}\n'
    )
    assert events.bounded_line(event, max_bytes=100) == (
        b'{"detail":{"cut_from_bytes":5092},"job_id":null,"kind":"slots.reserve","ts":1.0,'
        b'"uid":5}\n'
    )
    short = events.make_event("x", ts=1.0, a="b")
    assert events.bounded_line(short) == events.format_event(short)


def test_a_users_events_have_a_rate_and_root_is_not_bound_by_it(tmp_path: Path) -> None:
    now = [0.0]
    path = tmp_path / "events.jsonl"
    log = EventLog(path, user_bytes_per_min=1000, clock=lambda: now[0])
    for i in range(40):  # ~100 bytes each: the first ~10 fit in a minute's allowance
        log.append("spam", charge_uid=1001, uid=1001, i=i)
    log.append("prolog", uid=0, job_id="7")
    log.append("theirs", charge_uid=1002, uid=1002)  # another user's allowance is their own
    # the prolog's event about the spammer's job is not the spammer's request: written
    log.append("job.start", uid=1001, job_id="8")
    kinds = _kinds(path)
    assert 5 <= kinds.count("spam") <= 15 and kinds[-3:] == ["prolog", "theirs", "job.start"]
    written = kinds.count("spam")
    now[0] = 60.0  # a minute on: the allowance is back, and the count is logged first
    log.append("spam", charge_uid=1001, uid=1001, i=99)
    last = events.parse_lines(path.read_bytes())[-2:]
    assert last[0]["kind"] == "events.suppressed" and last[0]["uid"] == 1001
    assert last[0]["detail"] == {"count": 40 - written,
                                 "reason": "more than 1000 bytes of events of this uid in a "
                                           "minute"}  # fmt: skip
    assert last[1]["kind"] == "spam" and last[1]["detail"] == {"i": 99}
