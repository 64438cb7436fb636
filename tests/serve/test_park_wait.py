"""The instance's wait inside ``park`` (spswap.serve.checkpointer), with scripted daemon
answers: what it makes of each checkpoint state when its wait slice runs out. The real
daemon path is covered by tests/checkpoint/test_serve_criu.py and test_faults.py; this
covers the case they cannot reach in test time: a slice that ran out while the process
was dumped or kept frozen for longer than the slice."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from spswap.config import Config
from spswap.serve import checkpointer
from spswap.serve.checkpointer import DaemonCheckpointer


class _Answers:
    """The daemon's answers to checkpoint.status, in turn (the last one repeats)."""

    def __init__(self, states: list[str]) -> None:
        self.states = states
        self.calls = 0

    def call(self, op: str, **_: Any) -> dict[str, Any]:
        if op == "checkpoint":
            return {"accepted": True}
        state = self.states[min(self.calls, len(self.states) - 1)]
        self.calls += 1
        return {"state": state, "restart_count": 1, "reason": f"why {state}"}


def _park(monkeypatch: pytest.MonkeyPatch, states: list[str], resume_after_s: float | None
          ) -> tuple[checkpointer.ParkOutcome, _Answers]:  # fmt: skip
    monkeypatch.setattr(checkpointer, "PARK_SLICE_S", 0.01)
    answers = _Answers(states)
    ck = DaemonCheckpointer(Config.from_env({}), wait_s=5.0)
    monkeypatch.setattr(ck, "_client", lambda: answers)
    if resume_after_s is not None:

        def resume() -> None:
            answers.states = ["restored"]
            answers.calls = 0
            ck.resumed.set()

        threading.Timer(resume_after_s, resume).start()
    return ck.park("7", {}), answers


def test_saved_seen_after_a_long_freeze_waits_for_the_resume(monkeypatch) -> None:
    """A slice that ran out while dumped or kept: "saved" means a restore is under way."""
    outcome, answers = _park(monkeypatch, ["saved"], resume_after_s=0.2)
    assert outcome.state == "restored" and outcome.restart_count == 1
    assert answers.calls >= 1


def test_a_failed_dump_ends_the_wait(monkeypatch) -> None:
    outcome, _ = _park(monkeypatch, ["dumping", "dumping", "failed"], resume_after_s=None)
    assert outcome.state == "failed" and outcome.reason == "why failed"
