"""A run's stop: its GPU slot's release (a failure is said, the checkpoint goes on) and the note
its instance record keeps."""

from __future__ import annotations

from pathlib import Path

from spswap.config import Config
from spswap.daemon.lifecycle import prepare_dirs
from spswap.liveness import Holder
from spswap.serve.slot_hold import RunSlot
from spswap.slots.table import SlotTable


def test_a_release_that_fails_is_said_not_raised(tmp_path: Path) -> None:
    """The admin walk: root released a job's reservation by hand (`spswap slots release`),
    and at the job's next stop `spswap serve` died on "no reservation" before its
    checkpoint. Now the release's failure is a text the run logs, and it goes on."""
    cfg = Config.from_env({}, root=tmp_path / "root")
    prepare_dirs(cfg)
    table = SlotTable(cfg.paths.slots, [0])
    slot = RunSlot(cfg, model="m", units=1, gpus=(0,), job_id="5", timeout_s=5.0)
    slot.reservation = table.reserve(model="m", units=1, holder=Holder.current(job_id="5"),
                                     timeout_s=5.0)  # fmt: skip
    rid = slot.reservation.id
    table.release(rid)  # the admin's release, before the run's
    problem = slot.release()
    assert problem is not None and problem.startswith(f"could not give back GPU slot {rid} (")
    assert slot.release() is None and slot.reservation is None  # once


def test_a_parked_instance_record_drops_its_start_note() -> None:
    from spswap.serve.lifecycle import record_note

    note = "starts anew: job 39 has no checkpoint image (never dumped on this node)"
    assert record_note("up", note) == note
    assert record_note("checkpoint", note) is None  # saved now: the note would contradict it
