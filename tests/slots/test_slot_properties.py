"""Property tests: several real processes reserve and release at random.

Each example starts 2-4 worker processes (tests/slots/slot_worker.py) on a fresh table
with random plans; some are SIGKILLed while holding. An independent checker reads the
workers' append-only grant log and verifies that no unit was ever granted twice at once,
that requests sharing a GPU were granted in ticket order, and that every reservation of
a killed process was reclaimed.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from slot_harness import check_fifo, check_no_double_grant, intervals, run_scenario

from spswap.slots.table import SlotTable


@st.composite
def op(draw: st.DrawFn, gpus: list[int]) -> dict[str, Any]:
    allowed = draw(st.none() | st.lists(st.sampled_from(gpus), min_size=1, unique=True))
    n_allowed = len(allowed) if allowed else len(gpus)
    hold_s = draw(st.sampled_from([0.0, 0.002, 0.01, 0.03]))
    if n_allowed > 1 and draw(st.booleans()):
        return {"whole": draw(st.integers(1, n_allowed)), "allowed": allowed, "hold_s": hold_s}
    return {"units": draw(st.sampled_from([1, 2, 4])), "allowed": allowed, "hold_s": hold_s}


@st.composite
def scenario(draw: st.DrawFn, max_workers: int = 4, max_ops: int = 4) -> dict[str, Any]:
    gpus = list(range(draw(st.integers(1, 2))))
    workers = [
        {
            "ops": draw(st.lists(op(gpus), min_size=1, max_size=max_ops)),
            "kill": draw(st.booleans()),
        }
        for _ in range(draw(st.integers(2, max_workers)))
    ]
    return {"gpus": gpus, "workers": workers}


def _check(sc: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory(prefix="spswap-slots-") as d:
        slots, log = Path(d) / "slots", Path(d) / "grants.log"
        events = run_scenario(slots, sc["gpus"], log, sc["workers"], timeout_s=90)
        expected = sum(len(w["ops"]) for w in sc["workers"])
        assert sum(e["ev"] == "grant" for e in events) == expected
        check_no_double_grant(events)
        check_fifo(events)
        table = SlotTable(slots, sc["gpus"])
        killed = {iv["rid"] for iv in intervals(events) if iv["final"]}
        assert len(killed) == sum(w["kill"] for w in sc["workers"])
        # Every reservation left belonged to a killed process, and a locked read reclaims them.
        assert {r.id for r in table.reclaim_stale()} <= killed
        assert table.reservations() == []
        assert table.waiters() == []


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)  # fmt: skip
@given(scenario())
def test_random_processes_never_share_a_unit_and_keep_fifo(sc: dict[str, Any]) -> None:
    _check(sc)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario(max_workers=6, max_ops=8))
def test_random_processes_many(sc: dict[str, Any]) -> None:
    _check(sc)


def _grant(w: str, rid: str, keys: list, cands: list, granted_at: float, t: int) -> dict:
    return {"ev": "grant", "w": w, "rid": rid, "ticket": int(rid[1:]), "keys": keys,
            "cands": cands, "granted_at": granted_at, "t": t, "final": False}  # fmt: skip


def test_checker_catches_a_double_grant() -> None:
    events = [
        _grant("a", "r1", [[0, 0]], [0], 1.0, 100),
        _grant("b", "r2", [[0, 0], [0, 1]], [0], 2.0, 150),
        {"ev": "release", "w": "a", "rid": "r1", "t": 200},
        {"ev": "release", "w": "b", "rid": "r2", "t": 300},
    ]
    with pytest.raises(AssertionError, match="GPU 0 unit 0 granted twice"):
        check_no_double_grant(events)


def test_checker_catches_a_fifo_violation() -> None:
    events = [
        _grant("a", "r1", [[0, 0]], [0, 1], 2.0, 100),
        _grant("b", "r2", [[1, 0]], [1], 1.0, 90),
        {"ev": "release", "w": "a", "rid": "r1", "t": 200},
        {"ev": "release", "w": "b", "rid": "r2", "t": 300},
    ]
    with pytest.raises(AssertionError, match="ticket 2 .* before earlier ticket 1"):
        check_fifo(events)
    # Disjoint GPUs may be served in any order.
    events[0]["cands"] = [0]
    check_fifo(events)
