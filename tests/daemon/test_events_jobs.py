"""The event log (append, tail, torn lines, follow) and the job records on tmpfs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spswap.daemon import events
from spswap.daemon.jobs import JobRecord, JobStore, check_job_id
from spswap.errors import BadRequest


def test_format_event_bytes() -> None:
    e = events.make_event("job.start", job_id="42", uid=1000, ts=1700000000.5, gpus=[0])
    assert events.format_event(e) == (
        b'{"detail":{"gpus":[0]},"job_id":"42","kind":"job.start","ts":1700000000.5,"uid":1000}\n'
    )


def test_append_and_tail(tmp_path: Path) -> None:
    log = tmp_path / "log" / "events.jsonl"
    assert events.tail(log, 5) == []
    for i in range(30):
        events.append(log, "k", job_id=str(i), uid=0, i=i)
    assert [e["job_id"] for e in events.tail(log, 3)] == ["27", "28", "29"]
    assert len(events.tail(log, 100)) == 30
    assert events.tail(log, 0) == []
    assert oct(os.stat(log).st_mode & 0o777) == "0o644"


def test_tail_tolerates_torn_last_line(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    events.append(log, "a")
    with open(log, "ab") as f:
        f.write(b'{"kind":"half-writ')
    assert [e["kind"] for e in events.tail(log, 10)] == ["a"]


def test_tail_spans_chunks(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    for i in range(400):
        events.append(log, "big", pad="x" * 1000, i=i)  # ~400 KB > one 64 KiB chunk
    got = events.tail(log, 200)
    assert [e["detail"]["i"] for e in got] == list(range(200, 400))


def test_follow_yields_new_events_only(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    events.append(log, "old")
    stream = events.follow(log, poll_s=0.01)
    events.append(log, "new1")
    with open(log, "ab") as f:
        f.write(b'{"kind":"torn"')  # completed below: must be read once, whole
    assert next(stream)["kind"] == "new1"
    with open(log, "ab") as f:
        f.write(b',"ts":1}\n')
    assert next(stream)["kind"] == "torn"


def test_job_store_round_trip_and_prune(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs")
    store.put(JobRecord(job_id="7", uid=1000, user="ann", gpus=[1], registered_at=1.0))
    store.put(JobRecord(job_id="8_3", uid=0, state="ended", ended_at=100.0))
    store.put(JobRecord(job_id="9", uid=0, state="requeued", ended_at=100.0))
    got = store.get("7")
    assert got is not None and (got.uid, got.user, got.gpus) == (1000, "ann", [1])
    assert store.get("nope") is None
    assert store.prune(now=100.0 + 10) == []
    assert store.prune(now=100.0 + 10**6) == ["8_3"]  # requeued records stay
    assert sorted(j.job_id for j in store.all()) == ["7", "9"]


@pytest.mark.parametrize("bad", ["../etc/passwd", "a/b", "", ".", "..", "x" * 65, "1 2"])
def test_job_ids_are_safe_file_names(bad: str) -> None:
    with pytest.raises(BadRequest, match="is not a Slurm job id"):
        check_job_id(bad)


def test_an_event_about_a_job_carries_its_owners_uid(tmp_path: Path) -> None:
    """spswapd's events name whose job each is, also where the caller gave no uid."""
    from spswap.config import Config
    from spswap.daemon import lifecycle
    from spswap.daemon.state import DaemonState

    cfg = Config.from_env({}, root=tmp_path / "root")
    lifecycle.prepare_dirs(cfg)
    st = DaemonState(cfg)
    st.jobs.put(JobRecord(job_id="7", uid=1234, user="ann"))
    st.event("checkpoint.parked", job_id="7", pids=[1])
    st.event("checkpoint.parked", job_id="8", pids=[1])  # not registered here
    st.event("job.start", job_id="7", uid=0)  # the caller's uid stands
    st.event("sweep.failed", reason="x")
    got = [(e["job_id"], e["uid"]) for e in events.tail(cfg.paths.events, 9)]
    assert got == [("7", 1234), ("8", None), ("7", 0), (None, None)]
