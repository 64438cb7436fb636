"""A kept tree's sleeping GPU state kept on its GPU while its job waits
(``SPSWAP_KEEP_ON_GPU``; spswap.daemon.prewake with ``resident``): woken right after its
dump, left there by the epilog of the run it was dumped from and by the next prolog, only
unlocked by the job's next run, and ended (its image stays) when another job's slot
reservation is granted on its GPU, also one granted while it was being woken. The CUDA
and cgroup calls are stand-ins here (no GPU; the real ones run on a GPU in
tests/engines/test_vllm_serve_gpu.py, fate ``on_gpu``); the daemon state, its locks,
statuses, kept trees, slot table and events are the real ones."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from spswap.config import Config
from spswap.daemon import job_ops, prewake, slot_ops
from spswap.daemon.jobs import JobRecord
from spswap.daemon.state import Context, DaemonState
from spswap.slots.table import SlotTable


def _root(st: DaemonState) -> Context:
    return Context(state=st, peer_uid=0, peer_pid=os.getpid())


@pytest.fixture
def on_gpu(kept7: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Job 7's kept tree, its job on GPU 0 of a two-GPU slot table."""
    st, kept, calls, gpus, events = kept7
    table = SlotTable(st.cfg.paths.slots, [0, 1])
    monkeypatch.setattr(st, "slot_table", lambda: table)
    st.jobs.put(JobRecord(job_id="7", uid=os.getuid(), user="u", gpus=[0]))
    return st, kept, calls, events


def test_keep_on_gpu_is_a_yes_no_setting_off_by_default() -> None:
    assert Config.from_env({}).keep_on_gpu is False
    assert Config.from_env({"SPSWAP_KEEP_ON_GPU": "1"}).keep_on_gpu is True


def test_woken_after_its_dump_it_stays_past_its_runs_epilog_and_hold_time(
    on_gpu: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    st, kept, calls, events = on_gpu
    monkeypatch.setattr(prewake, "HOLD_S", 0.05)  # (a tree woken at a prolog: ended by then)
    assert prewake.wake_early(st, "7", resident=True)
    assert calls == ["thaw", "cuda_restore unlock=False", "freeze"]
    assert kept.resident and kept.gpu_back_s is not None and st.kept.resident() == [kept]
    assert [k for k, _ in events] == ["kept.on_gpu"]
    assert st.statuses.read("7")["on_gpu"] is True  # (`spswap status`: "kept alive on its GPU")
    # the epilog of the run it was dumped from (its job requeued): it waits for the next run
    job_ops.op_job_end(_root(st), {"job_id": "7", "requeued": True})
    time.sleep(0.2)
    assert st.kept.has("7") and "kill" not in calls
    # the next run's prolog: nothing to wake again; its restore then only unlocks
    assert not prewake.wake_early(st, "7")
    assert calls == ["thaw", "cuda_restore unlock=False", "freeze"]


def test_not_kept_on_a_gpu_where_another_job_holds_a_slot(on_gpu: Any) -> None:
    st, kept, calls, events = on_gpu
    st.slot_table().reserve(model="m", units=1, allowed_gpus=[0], holder=_holder("8"),
                            timeout_s=1)  # fmt: skip
    assert not prewake.wake_early(st, "7", resident=True)
    assert calls == [] and st.kept.has("7") and not kept.resident, "kept in host memory"
    assert [(k, f["reason"]) for k, f in events] == [
        ("kept.not_on_gpu", "job(s) 8 hold slots on its GPUs")]  # fmt: skip


def test_a_slot_granted_while_it_was_woken_ends_it(
    on_gpu: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grant came after the check before the wake: checked again as it is kept."""
    st, kept, calls, events = on_gpu
    real_wake = prewake.wake_kept

    def wake_then_granted(*a: Any, **kw: Any) -> dict[str, float]:
        st.slot_table().reserve(model="m", units=4, allowed_gpus=[0], holder=_holder("8"),
                                timeout_s=1)  # fmt: skip
        return real_wake(*a, **kw)

    monkeypatch.setattr(prewake, "wake_kept", wake_then_granted)
    assert not prewake.wake_early(st, "7", resident=True)
    assert not st.kept.has("7") and calls[-2:] == ["kill", "remove"]
    ended = [f["reason"] for k, f in events if k == "kept.ended"]
    assert ended == ["job(s) 8 hold slots on its GPUs: its GPU state is not kept on the GPU; "
                     "its image stays"]  # fmt: skip
    assert (st.cfg.paths.images / kept.key).is_dir()


def test_another_jobs_reservation_on_its_gpu_ends_it_its_own_and_other_gpus_do_not(
    on_gpu: Any,
) -> None:
    st, kept, calls, events = on_gpu
    assert prewake.wake_early(st, "7", resident=True)
    for job_id, gpu in (("7", 0), ("9", 1)):  # its own run's; another job on GPU 1
        st.jobs.put(JobRecord(job_id=job_id, uid=os.getuid(), user="u", gpus=[gpu]))
        slot_ops.op_slots_reserve(_root(st), {"model": "m", "units": 1, "job_id": job_id,
                                              "allowed_gpus": [gpu], "timeout_s": 1})  # fmt: skip
    assert st.kept.has("7") and "kill" not in calls
    st.jobs.put(JobRecord(job_id="8", uid=os.getuid(), user="u", gpus=[0]))
    slot_ops.op_slots_reserve(_root(st), {"model": "m", "units": 1, "job_id": "8",
                                          "allowed_gpus": [0], "timeout_s": 1})  # fmt: skip
    assert not st.kept.has("7") and calls[-2:] == ["kill", "remove"]
    ended = [f["reason"] for k, f in events if k == "kept.ended"]
    assert ended == ["job 8 reserved a slot on its GPU, where its GPU state was kept: its "
                     "next run restores from the image"]  # fmt: skip
    assert (st.cfg.paths.images / kept.key).is_dir(), "the image is the way back"
    assert st.statuses.read("7")["kept"] is False and st.statuses.read("7")["on_gpu"] is False


def test_a_restore_that_fails_before_taking_it_ends_it(on_gpu: Any) -> None:
    """Its run starts cold then, and needs that GPU memory."""
    from spswap.daemon.ckpt_restore import op_restore
    from spswap.errors import SpswapError

    st, kept, calls, _ = on_gpu
    assert prewake.wake_early(st, "7", resident=True)
    with pytest.raises(SpswapError, match="identity incomplete"):
        op_restore(Context(peer_uid=os.getuid(), peer_pid=os.getpid(), state=st),
                   {"job_id": "7"})  # fmt: skip
    assert not st.kept.has("7") and calls[-2:] == ["kill", "remove"]


def _holder(job_id: str) -> Any:
    from spswap.liveness import Holder, pid_start_time

    return Holder(pid=os.getpid(), pid_start=pid_start_time(os.getpid()), uid=os.getuid(),
                  job_id=job_id, since=time.time())  # fmt: skip
