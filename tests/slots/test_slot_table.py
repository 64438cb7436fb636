"""The slot table with real files, a real lock and real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slot_harness import check_fifo, check_no_double_grant, read_log, start_worker, wait_for

from spswap.config import Config
from spswap.errors import PermissionDenied, SlotError, SlotTimeout
from spswap.liveness import Holder
from spswap.slots.table import Reservation, SlotTable


def _table(tmp_path: Path, gpus: list[int] = [0, 1], **kw: object) -> SlotTable:  # noqa: B006
    return SlotTable(tmp_path / "slots", gpus, poll_interval_s=0.005, **kw)  # type: ignore[arg-type]


def _dead_pid() -> int:
    """The pid of a process that ran and was killed (and reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    p.kill()
    p.wait()
    return p.pid


def test_reserve_release_roundtrip_and_state_file(tmp_path: Path) -> None:
    t = _table(tmp_path)
    r = t.reserve(model="llama", units=2)
    assert r.gpus == (0,) and r.units == (0, 1) and r.holder.pid == os.getpid()
    data = json.loads((tmp_path / "slots" / "state.json").read_text())
    assert data["version"] == 1 and data["reservations"][0]["id"] == r.id
    assert Reservation.from_json(r.to_json()) == r
    assert t.reservations() == [r]
    assert t.release(r.id) == r
    assert t.reservations() == []


def test_whole_gpus_and_packing(tmp_path: Path) -> None:
    t = _table(tmp_path, [0, 1, 2])
    a = t.reserve(model="a", units=1)
    b = t.reserve(model="b", units=1)
    c = t.reserve(model="c", units=2)
    assert {a.gpus, b.gpus, c.gpus} == {(0,)}
    w = t.reserve(model="w", whole_gpus=2)
    assert w.gpus == (1, 2) and w.units == (0, 1, 2, 3)
    snap = t.snapshot()
    assert [g["units_free"] for g in snap["gpus"]] == [0, 0, 0]
    assert snap["gpus"][1]["units"] == [w.id] * 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"units": 3}, "units must be one of 1, 2, 4"),
        ({"units": 8}, "use whole_gpus"),
        ({"whole_gpus": 3}, "whole_gpus must be 1..2 (GPUs 0, 1), got 3"),
        ({"whole_gpus": 0}, "whole_gpus must be 1..2"),
        ({"whole_gpus": 1, "units": 2}, "either units (2) or whole_gpus (1)"),
        ({"allowed_gpus": [7]}, "valid GPUs: 0, 1"),
        ({"allowed_gpus": [0], "whole_gpus": 2}, "whole_gpus must be 1..1 (GPUs 0)"),
    ],
)
def test_validation_lists_valid_values(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(SlotError) as e:
        _table(tmp_path).reserve(model="m", timeout_s=0, **kwargs)
    assert message in str(e.value)


def test_no_gpus_says_how_to_set_them(tmp_path: Path) -> None:
    with pytest.raises(SlotError, match="SPSWAP_GPUS"):
        _table(tmp_path, []).reserve(model="m")


def test_release_of_another_users_reservation(tmp_path: Path) -> None:
    t = _table(tmp_path)
    other = Holder(pid=os.getpid(), pid_start=None, uid=4242, since=time.time())
    r = t.reserve(model="m", units=1, holder=other)
    with pytest.raises(PermissionDenied, match="belongs to uid 4242, not to uid 1000"):
        t.release(r.id, uid=1000)
    assert t.release(r.id, uid=0) == r  # root may


def test_release_of_an_unknown_id_lists_current_ones(tmp_path: Path) -> None:
    t = _table(tmp_path)
    a = t.reserve(model="a", units=1)
    with pytest.raises(SlotError) as e:
        t.release("r999")
    assert "'r999'" in str(e.value) and f"current reservations: {a.id}" in str(e.value)


def test_timeout_names_every_holder_and_the_fix(tmp_path: Path) -> None:
    t = _table(tmp_path, [0])
    h = Holder(pid=os.getpid(), pid_start=None, uid=1234, job_id="777", since=time.time())
    a = t.reserve(model="llama-8b", units=2, holder=h)
    b = t.reserve(model="qwen-1b", units=1)
    start = time.monotonic()
    with pytest.raises(SlotTimeout) as e:
        t.reserve(model="big", units=4, timeout_s=0.1)
    assert 0.1 <= time.monotonic() - start < 2
    msg = str(e.value)
    assert "no slot for model big" in msg and "after 0.1 s" in msg
    assert f"{a.id} (model llama-8b, job 777 of uid 1234, asked by pid {os.getpid()}, since " in msg
    assert f"{b.id} (model qwen-1b" in msg and "GPU 0 units 0,1" in msg
    assert "--timeout-s" in msg and "spswap slots release" in msg
    assert len(e.value.holders) == 2 and e.value.holders[0].startswith(a.id)
    assert t.waiters() == []  # the ticket went with the timeout


def test_stale_reservation_of_a_dead_process_is_reclaimed(tmp_path: Path) -> None:
    t = _table(tmp_path, [0])
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        r = t.reserve(model="m", units=4, holder=Holder.current(pid=proc.pid, job_id=""))
        assert t.reclaim_stale() == []
        assert t.reservations() == [r]
    finally:
        proc.kill()
        proc.wait()
    assert t.reclaim_stale() == [r]
    assert t.reservations() == []
    # and the GPU is free again for a new request, without waiting
    assert t.reserve(model="n", units=4, timeout_s=0).gpus == (0,)


def test_reclaim_happens_on_reserve(tmp_path: Path) -> None:
    t = _table(tmp_path, [0])
    dead = Holder(pid=_dead_pid(), pid_start=None, uid=os.getuid(), since=time.time())
    t.reserve(model="old", holder=dead)
    assert t.reserve(model="new", timeout_s=0).model == "new"


def test_release_after_reclaim_is_not_an_error(tmp_path: Path) -> None:
    t = _table(tmp_path, [0])
    dead = Holder(pid=_dead_pid(), pid_start=None, uid=os.getuid(), since=time.time())
    r = t.reserve(model="old", holder=dead)
    assert t.release(r.id).id == r.id


def test_a_reused_pid_is_not_the_old_holder(tmp_path: Path) -> None:
    t = _table(tmp_path, [0])
    me = Holder.current()
    impostor = Holder(pid=me.pid, pid_start=(me.pid_start or 0) + 1, uid=me.uid, since=me.since)
    t.reserve(model="m", holder=impostor)
    assert t.reservations() == []


@pytest.mark.parametrize(
    ("verdict", "kept"),
    [(True, True), (False, False), (None, False)],
)
def test_job_bound_holder_follows_the_job_probe(
    tmp_path: Path, verdict: bool | None, kept: bool
) -> None:
    asked: list[str] = []

    def probe(job_id: str) -> bool | None:
        asked.append(job_id)
        return verdict

    t = _table(tmp_path, [0], job_alive=probe)
    holder = Holder(pid=_dead_pid(), pid_start=None, uid=os.getuid(), job_id="4321", since=0.0)
    t.reserve(model="m", holder=holder)
    assert (len(t.reservations()) == 1) is kept
    assert "4321" in asked


def test_live_process_is_not_asked_about_its_job(tmp_path: Path) -> None:
    def probe(job_id: str) -> bool | None:
        raise AssertionError("the job probe must not run for a live process")

    t = _table(tmp_path, [0], job_alive=probe)
    t.reserve(model="m", holder=Holder.current(job_id="55"))
    assert len(t.reservations()) == 1


def test_lock_file_is_never_unlinked(tmp_path: Path) -> None:
    t = _table(tmp_path)
    t.reservations()
    lock = tmp_path / "slots" / "slots.lock"
    inode = lock.stat().st_ino
    for _ in range(20):
        t.release(t.reserve(model="m", units=1).id)
    assert lock.stat().st_ino == inode


def test_from_config_uses_the_configured_gpus(tmp_path: Path) -> None:
    cfg = Config.from_env({"SPSWAP_ROOT": str(tmp_path), "SPSWAP_GPUS": "2,3"})
    t = SlotTable.from_config(cfg)
    assert t.gpus == (2, 3) and t.slots_dir == tmp_path / "slots"
    assert t.poll_interval_s == cfg.slot_poll_interval_s


def test_newer_state_version_is_refused(tmp_path: Path) -> None:
    t = _table(tmp_path)
    t.reservations()
    (tmp_path / "slots" / "state.json").write_text('{"version": 9}')
    with pytest.raises(Exception, match="version 9"):
        t.reservations()


def test_waiters_are_served_first_come_first_served(tmp_path: Path) -> None:
    """A later small request does not overtake an earlier whole-GPU request."""
    slots, log = tmp_path / "slots", tmp_path / "grants.log"
    t = _table(tmp_path, [0])
    blocker = t.reserve(model="blocker", units=1)
    big = start_worker(slots, [0], log, "big", [{"units": 4, "hold_s": 0.2}])
    wait_for(lambda: len(t.waiters()) == 1, 20, "the whole-GPU waiter to queue")
    small = start_worker(slots, [0], log, "small", [{"units": 1, "hold_s": 0.0}])
    wait_for(lambda: len(t.waiters()) == 2, 20, "the quarter waiter to queue")
    assert [q.model for q in t.waiters()] == ["big-0", "small-0"]
    time.sleep(0.1)
    assert read_log(log) == []  # three units are free, yet the small one waits its turn
    t.release(blocker.id)
    for p in (big, small):
        assert p.wait(timeout=30) == 0, p.stderr.read() if p.stderr else ""
    events = read_log(log)
    grants = [e["w"] for e in events if e["ev"] == "grant"]
    assert grants == ["big", "small"]
    check_no_double_grant(events)
    check_fifo(events)


def test_dead_waiter_leaves_the_queue(tmp_path: Path) -> None:
    slots, log = tmp_path / "slots", tmp_path / "grants.log"
    t = _table(tmp_path, [0])
    t.reserve(model="blocker")
    w = start_worker(slots, [0], log, "w", [{"units": 1}])
    wait_for(lambda: len(t.waiters()) == 1, 20, "the waiter to queue")
    w.kill()
    w.wait()
    assert t.waiters() == []


def test_a_killed_waiter_leaves_the_queue_though_its_holder_lives(tmp_path: Path) -> None:
    """`spswap slots reserve` ties its reservation to the calling shell, but its place in
    line belongs to the waiting process: SIGKILL it and the place goes, shell or not."""
    import subprocess
    import sys

    t = _table(tmp_path, [0])
    t.reserve(model="blocker")
    code = (
        "import os, sys; from pathlib import Path; "
        "from spswap.liveness import Holder; from spswap.slots.table import SlotTable; "
        f"SlotTable(Path({str(tmp_path / 'slots')!r}), [0], poll_interval_s=0.01).reserve("
        "model='w', units=1, holder=Holder.current(pid=os.getppid()), timeout_s=60)"
    )
    w = subprocess.Popen([sys.executable, "-c", code])
    wait_for(lambda: len(t.waiters()) == 1, 20, "the waiter to queue")
    assert t.waiters()[0].holder.pid == os.getpid()  # the holder: this (live) process
    w.kill()
    w.wait()
    assert t.waiters() == []
