"""Job and checkpoint states are enums inside spswap and plain words on disk, on the wire
and in messages (what `spswap status --json` and older records have)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spswap.daemon.jobs import JobRecord, JobState, JobStore
from spswap.daemon.statuses import CheckpointState, CheckpointStatuses


def test_job_records_keep_their_state_as_a_word(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    store.put(JobRecord(job_id="7", uid=1000, state=JobState.REQUEUED))
    assert json.loads((tmp_path / "7.json").read_text())["state"] == "requeued"
    assert store.get("7").state is JobState.REQUEUED  # type: ignore[union-attr]
    (tmp_path / "8.json").write_text(json.dumps({"job_id": "8", "uid": 1, "state": "ended"}))
    assert store.get("8").state is JobState.ENDED  # type: ignore[union-attr]


def test_an_unknown_job_state_is_an_error_not_a_new_state(tmp_path: Path) -> None:
    (tmp_path / "9.json").write_text(json.dumps({"job_id": "9", "uid": 1, "state": "zombie"}))
    with pytest.raises(ValueError, match="zombie"):
        JobStore(tmp_path).get("9")


def test_checkpoint_states_compare_with_what_the_wire_carries(tmp_path: Path) -> None:
    statuses = CheckpointStatuses(tmp_path)
    statuses.write("3", state=CheckpointState.SAVED, kept=True)
    raw = json.loads(statuses.path("3").read_text())
    assert raw["state"] == "saved" and raw["state"] == CheckpointState.SAVED
    assert f"dump {CheckpointState.SAVED}; job {JobState.ENDED}" == "dump saved; job ended"
