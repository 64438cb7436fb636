"""The daemon's kept trees (KeptTrees): how a tree comes in and leaves, what its job's
status and the event log say then. The trees' processes are stand-ins here; the real
ones (CRIU, frozen cgroups) are in tests/checkpoint/test_faults.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spswap.daemon.kept import Kept, KeptTrees
from spswap.daemon.statuses import CheckpointStatuses


class FakeParking:
    """What a kept tree needs of its parked cgroups."""

    def __init__(self, pids: set[int]) -> None:
        self._pids = set(pids)
        self.removed = False

    def pids(self) -> set[int]:
        return set(self._pids)

    def kill_all(self) -> list[int]:
        killed, self._pids = sorted(self._pids), set()
        return killed

    def remove(self) -> None:
        self.removed = True


@pytest.fixture
def statuses(tmp_path: Path) -> CheckpointStatuses:
    return CheckpointStatuses(tmp_path / "checkpoints")


@pytest.fixture
def events() -> list[tuple[str, dict[str, Any]]]:
    return []


@pytest.fixture
def trees(statuses: CheckpointStatuses, events: list[tuple[str, dict[str, Any]]]) -> KeptTrees:
    return KeptTrees(statuses, lambda kind, **fields: events.append((kind, fields)))


def _kept(statuses: CheckpointStatuses, job_id: str, pid: int, key: str,
          since: float = 0.0) -> Kept:  # fmt: skip
    statuses.write(job_id, state="saved", pid=pid, key=key, kept=True)
    return Kept(job_id, pid, None, FakeParking({pid, pid + 1}), key, since)


def test_end_kills_the_tree_unmarks_its_status_and_logs_why(
    trees: KeptTrees, statuses: CheckpointStatuses, events: list[Any]
) -> None:
    kept = _kept(statuses, "7", 100, "img7")
    trees.add(kept)
    assert trees.jobs_of_image("img7") == ["7"]
    assert trees.end("7", "the job dumps again")
    assert kept.parking.pids() == set() and kept.parking.removed
    assert statuses.read("7") == {"job_id": "7", "state": "saved", "pid": 100, "key": "img7",
                                  "kept": False}  # fmt: skip
    assert events == [("kept.ended", {"job_id": "7", "pid": 100,
                                      "reason": "the job dumps again"})]  # fmt: skip
    assert not trees.end("7", "again")  # gone already: nothing more happens
    assert len(events) == 1


def test_end_for_an_image_leaves_a_tree_of_another_image(
    trees: KeptTrees, statuses: CheckpointStatuses
) -> None:
    trees.add(_kept(statuses, "7", 100, "new"))
    assert not trees.end("7", "its image was dropped", image_key="old")
    assert trees.jobs_of_image("new") == ["7"]
    assert statuses.read("7")["kept"] is True


def test_a_taken_tree_is_the_takers_own(
    trees: KeptTrees, statuses: CheckpointStatuses, events: list[Any]
) -> None:
    kept = _kept(statuses, "7", 100, "img7")
    trees.add(kept)
    assert trees.take("7") is kept
    assert trees.take("7") is None
    assert not trees.end("7", "its job ended")  # no longer the daemon's to end
    assert kept.parking.pids() == {100, 101} and events == []
    trees.end_taken(kept, "it was gone when its job came back")
    assert kept.parking.pids() == set() and statuses.read("7")["kept"] is False
    assert [kind for kind, _ in events] == ["kept.ended"]


def test_kill_ends_the_processes_only(trees: KeptTrees, statuses: CheckpointStatuses,
                                      events: list[Any]) -> None:  # fmt: skip
    kept = _kept(statuses, "7", 100, "img7")
    assert kept.kill() == [100, 101]
    assert statuses.read("7")["kept"] is True and events == []


def test_trim_to_ends_the_oldest_until_the_rest_fit(
    trees: KeptTrees, statuses: CheckpointStatuses, events: list[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from spswap.checkpoint import proctree

    size_by_pid = {100: 5, 200: 3, 300: 4}
    monkeypatch.setattr(proctree, "anon_rss_bytes",
                        lambda pids: sum(size_by_pid.get(p, 0) for p in pids))  # fmt: skip
    for job_id, pid, since in [("mid", 200, 2.0), ("old", 100, 1.0), ("new", 300, 3.0)]:
        trees.add(_kept(statuses, job_id, pid, f"img-{job_id}", since))
    trees.trim_to(8)
    assert [f["job_id"] for _, f in events] == ["old"]
    assert events[0][1]["reason"] == ("over the keep budget (12 > 8 bytes): its next run "
                                      "restores from the image")  # fmt: skip
    assert trees.jobs_of_image("img-old") == []
    assert trees.jobs_of_image("img-mid") == ["mid"] and trees.jobs_of_image("img-new") == ["new"]


def test_left_job_is_marked_only_on_a_dumping_status(statuses: CheckpointStatuses) -> None:
    statuses.write("9", state="dumping", pid=41, pid_start=7)
    statuses.mark_left_job("9")
    assert statuses.read("9") == {"job_id": "9", "state": "dumping", "pid": 41,
                                  "pid_start": 7, "left_job": True}  # fmt: skip
    # a dump that ended meanwhile keeps its own status: a later run must not read it
    statuses.write("9", state="saved", pid=41)
    statuses.mark_left_job("9")
    assert statuses.read("9") == {"job_id": "9", "state": "saved", "pid": 41}
    statuses.mark_left_job("10")  # no status: nothing is written
    assert statuses.read("10") == {}
    statuses.write("11", state="dumping", pid=42, pid_start=8)
    statuses.mark_left_job("11", requeued=True)  # spswapd requeued the job itself
    assert statuses.read("11") == {"job_id": "11", "state": "dumping", "pid": 42,
                                   "pid_start": 8, "left_job": True, "requeued": True}  # fmt: skip
