"""The slot table's pure state and rules (no files, no lock, no processes), and the state
file as earlier releases wrote it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spswap.errors import PermissionDenied, SlotError, SlotTimeout
from spswap.fsutil import atomic_write_json
from spswap.liveness import Holder
from spswap.slots.request import make_request, timeout_error
from spswap.slots.state import (
    Reservation,
    SlotRequest,
    SlotState,
    Waiter,
    WaitingProcess,
    build_snapshot,
)
from spswap.slots.store import SlotStore
from spswap.slots.table import SlotTable

FIXTURE = Path(__file__).parent / "fixtures" / "state_v1.json"
A = Holder(pid=100, pid_start=7, uid=1000, job_id="1", since=1.0)
B = Holder(pid=200, pid_start=8, uid=1001, job_id=None, since=2.0)


def _waiter(ticket: int, req: SlotRequest, holder: Holder = B, pid: int = 300) -> Waiter:
    return Waiter(ticket, "w", req.units, req.whole_gpus, req.candidates, holder,
                  WaitingProcess(pid, 9), 5.0)  # fmt: skip


def test_grant_places_and_takes_the_ticket_out_of_line() -> None:
    st = SlotState()
    req = make_request((0, 1), 2, None, None)
    t = st.take_ticket()
    st.enqueue(_waiter(t, req))
    r = st.grant(t, req, A, "m", now=3.0)
    assert r == Reservation("r1", (0,), (0, 1), A, "m", 3.0)
    assert st.queue == [] and st.reservations == [r] and st.dirty and st.next_ticket == 2


def test_fifo_an_earlier_waiter_for_the_same_gpus_goes_first() -> None:
    st = SlotState()
    whole = make_request((0, 1), 4, 1, [0])
    small = make_request((0, 1), 1, None, [0])
    st.enqueue(_waiter(1, whole))
    assert st.grant(2, small, A, "m", now=0.0) is None  # it would fit, but ticket 1 waits
    other = make_request((0, 1), 1, None, [1])
    assert st.grant(3, other, A, "m", now=0.0) is not None  # another GPU: not held back
    assert [w.ticket for w in st.waiters_ahead(2, small)] == [1]


def test_a_barred_gpu_is_not_granted_and_the_request_waits_for_the_others() -> None:
    st = SlotState()
    req = make_request((0, 1), 4, None, None)
    assert st.grant(1, req, B, "m", now=0.0, barred=[0, 1]) is None
    r = st.grant(1, req, B, "m", now=0.0, barred=[0])
    assert r is not None and r.gpus == (1,)
    assert st.grant(2, make_request((0, 1), 4, 1, None), B, "m", now=0.0, barred=[0]) is None


def test_take_back_removes_the_picked_holders_reservations_and_places_in_line() -> None:
    st = SlotState()
    a = st.grant(1, make_request((0, 1), 1, None, [0]), A, "a", now=0.0)
    b = st.grant(2, make_request((0, 1), 1, None, [0]), B, "b", now=0.0)
    c = st.grant(3, make_request((0, 1), 1, None, [1]), B, "c", now=0.0)
    st.enqueue(_waiter(4, make_request((0, 1), 4, None, None)))  # B's, for GPU 0 or 1
    st.enqueue(_waiter(5, make_request((0, 1), 4, None, None), holder=A))
    st.dirty = False
    assert st.take_back([0], lambda h: h.job_id is None) == [b]
    assert st.reservations == [a, c] and st.dirty
    assert [w.candidates for w in st.queue] == [(1,), (0, 1)]  # A's place is A's
    # B's waiter holds back no one on GPU 0 now
    assert st.waiters_ahead(6, make_request((0, 1), 1, None, [0])) == [st.queue[1]]
    st.dirty = False
    assert st.take_back([0], lambda h: False) == [] and not st.dirty


def test_a_place_in_line_taken_back_is_judged_by_the_gpus_it_has_left() -> None:
    """The waiter's own attempts count the GPUs its place in line still has, as those
    behind it do: GPU 0 went to a job while B waited, so B is not placed there though
    it is free and its job has ended since; a place left with none ends the wait."""
    st = SlotState()
    both = make_request((0, 1), 4, None, None)
    st.enqueue(_waiter(1, both))
    st.take_back([0], lambda h: h.job_id is None)
    assert st.grant(2, make_request((0, 1), 4, None, [0]), A, "a", now=0.0) is not None
    st.reservations.clear()  # GPU 0 free again
    hold = Reservation("r0", (1,), (0, 1, 2, 3), A, "a", 0.0)
    st.reservations.append(hold)
    assert st.grant(1, both, B, "b", now=0.0) is None  # not GPU 0
    st.reservations.remove(hold)
    got = st.grant(1, both, B, "b", now=0.0)
    assert got is not None and got.gpus == (1,)

    st.enqueue(_waiter(4, make_request((0,), 4, None, None)))
    st.take_back([0], lambda h: h.job_id is None)
    with pytest.raises(SlotError, match=r"every GPU this request could take \(4 unit\(s\) on GPU "
                                        r"0\) was taken back while it waited"):  # fmt: skip
        st.grant(4, make_request((0,), 4, None, None), B, "b", now=0.0)
    assert not st.in_line(4)
    two = make_request((0, 1), 4, 2, None)  # two whole GPUs, and one of them taken back
    st.enqueue(_waiter(5, two))
    st.take_back([1], lambda h: h.job_id is None)
    fewer = r"all but 1 of the GPUs this request could take \(2 whole GPU\(s\) of GPUs 0,1\)"
    with pytest.raises(SlotError, match=fewer + " was taken back"):
        st.grant(5, two, B, "b", now=0.0)


def test_a_full_gpu_grants_nothing_and_names_its_holders() -> None:
    st = SlotState()
    req = make_request((0,), 4, None, None)
    first = st.grant(1, req, A, "a", now=0.0)
    assert first is not None and st.grant(2, req, B, "b", now=0.0) is None
    st.enqueue(_waiter(2, req))
    err = timeout_error(req, "b", 1.5, st.blockers(req), st.waiters_ahead(3, req))
    assert isinstance(err, SlotTimeout) and err.holders == [first.describe()]
    assert "after 1.5 s" in str(err) and "ticket 2 (model w, pid 200)" in str(err)


def test_enqueue_keeps_ticket_order_and_is_idempotent() -> None:
    st = SlotState()
    req = make_request((0,), 1, None, None)
    for t in (3, 1, 3, 2):
        st.enqueue(_waiter(t, req))
    assert [w.ticket for w in st.queue] == [1, 2, 3]
    st.dequeue(2)
    assert [w.ticket for w in st.queue] == [1, 3] and st.in_line(3) and not st.in_line(2)


def test_reclaim_drops_dead_holders_and_dead_waiting_processes() -> None:
    req = make_request((0, 1), 1, None, None)
    st = SlotState(
        [Reservation("r1", (0,), (0,), A, "a", 0.0), Reservation("r2", (1,), (0,), B, "b", 0.0)],
        [_waiter(3, req, holder=A, pid=301), _waiter(4, req, holder=A, pid=302)],
    )
    st.reclaim(lambda h: h == A, lambda pid, start: pid == 302 and start == 9)
    assert [r.id for r in st.reservations] == ["r1"] and [r.id for r in st.reclaimed] == ["r2"]
    assert [w.ticket for w in st.queue] == [4] and st.dirty
    assert st.release("r2", uid=5) == st.reclaimed[0]  # reclaimed: released either way


def test_release_only_by_the_holder_or_root() -> None:
    st = SlotState([Reservation("r1", (0,), (0,), A, "a", 0.0)])
    with pytest.raises(PermissionDenied, match="belongs to uid 1000"):
        st.release("r1", uid=1001)
    with pytest.raises(SlotError, match="current reservations: r1"):
        st.release("r9", uid=0)
    assert st.release("r1", uid=0).id == "r1" and st.reservations == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (((), 1, None, None), "no GPUs known"),
        (((0, 1), 1, None, [5]), r"GPU\(s\) \[5\] are not on this node; valid GPUs: 0, 1"),
        (((0, 1), 2, 1, None), "either units"),
        (((0, 1), 4, 3, None), "whole_gpus must be 1..2"),
        (((0, 1), 3, None, None), "units must be one of 1, 2, 4"),
    ],
)
def test_requests_that_can_never_be_met(args: tuple, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(SlotError, match=message):
        make_request(*args)


def test_waiter_json_with_and_without_the_waiting_process() -> None:
    req = make_request((0,), 1, None, None)
    w = _waiter(1, req)
    assert Waiter.from_json(w.to_json()) == w and w.process == WaitingProcess(300, 9)
    old = {k: v for k, v in w.to_json().items() if k != "waiter"}  # before it was recorded
    w_old = Waiter.from_json(old)
    assert w_old.waiter is None and w_old.process == WaitingProcess(B.pid, B.pid_start)
    assert w_old.to_json() == old


def test_snapshot_lists_units_per_gpu() -> None:
    r = Reservation("r1", (1,), (2, 3), A, "a", 0.0)
    w = _waiter(2, make_request((0, 1), 4, 1, None))
    snap = build_snapshot((0, 1), [r], [w])
    assert [g["units"] for g in snap["gpus"]] == [[None] * 4, [None, None, "r1", "r1"]]
    assert snap["waiters"] == [w.to_json()] and snap["reservations"] == [r.to_json()]


# -- the state file of the current format (written by the release before this split) ---


def test_a_state_file_of_the_current_format_round_trips_byte_for_byte(tmp_path: Path) -> None:
    assert SlotStore(tmp_path, lambda s: None).load() == SlotState()  # no file yet: empty
    shutil.copy(FIXTURE, tmp_path / "state.json")
    st = SlotStore(tmp_path, lambda s: None).load()
    assert [r.id for r in st.reservations] == ["r1", "r2"] and st.next_ticket == 4
    assert [(w.ticket, w.model, w.holder.job_id) for w in st.queue] == [(3, "mistral", "43")]
    assert st.to_json() == json.loads(FIXTURE.read_text())
    atomic_write_json(tmp_path / "again.json", st.to_json())
    assert (tmp_path / "again.json").read_bytes() == FIXTURE.read_bytes()


def test_a_table_loads_an_existing_state_file_and_goes_on(tmp_path: Path) -> None:
    """The fixture's holders are pid 1 (alive), its waiter a process long gone."""
    slots = tmp_path / "slots"
    slots.mkdir()
    shutil.copy(FIXTURE, slots / "state.json")
    t = SlotTable(slots, [0, 1, 2], poll_interval_s=0.005)
    assert [r.id for r in t.reservations()] == ["r1", "r2"]
    assert t.waiters() == []  # its waiting process died: its place went with it
    r = t.reserve(model="n", units=2, holder=Holder.current(), timeout_s=5)
    assert (r.id, r.gpus, r.units) == ("r4", (0,), (2, 3))  # the next ticket, the free half
    assert t.release("r1", uid=0).model == "llama-8b"


def test_the_fixture_is_what_the_format_writes(tmp_path: Path) -> None:
    """Rebuild the fixture's state through the table (same holders, requests and waiter)
    and compare the files once the times and the waiter's pid are set to the fixture's."""
    t = SlotTable(tmp_path, [0, 1, 2])
    t.reserve(model="llama-8b", units=2, holder=Holder(1, None, 0, "41", 1700000000.25))
    t.reserve(model="qwen", whole_gpus=2, holder=Holder(1, None, 1234, None, 1700000001.5))
    code = ("import sys; from pathlib import Path; from spswap.liveness import Holder; "
            "from spswap.slots.table import SlotTable; SlotTable(Path(sys.argv[1]), [0, 1, 2])"
            ".reserve(model='mistral', units=4, allowed_gpus=[0], "
            "holder=Holder(1, None, 1234, '43', 1700000002.75), timeout_s=60)")  # fmt: skip
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)])
    try:
        deadline = time.monotonic() + 30
        while not t.waiters():
            assert p.poll() is None and time.monotonic() < deadline, "the waiter never queued"
            time.sleep(0.02)
        got = json.loads((tmp_path / "state.json").read_text())
    finally:
        p.kill()
        p.wait()
    want = json.loads(FIXTURE.read_text())
    for k in (0, 1):
        got["reservations"][k]["granted_at"] = want["reservations"][k]["granted_at"]
    for key in ("enqueued_at", "waiter"):
        got["queue"][0][key] = want["queue"][0][key]
    assert got == want


def test_bookkeeping_loads_no_torch_cuda_nvml_or_slurm() -> None:
    code = ("import sys\n"
            "import spswap.slots.state, spswap.slots.request, spswap.slots.store\n"
            "import spswap.slots.table\n"
            "bad = {'torch', 'cuda', 'pynvml', 'pyslurm', 'spswap.slurm'}\n"
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in bad\n"
            "                      or m.startswith('spswap.slurm'))))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    assert out.stdout.strip() == ""
