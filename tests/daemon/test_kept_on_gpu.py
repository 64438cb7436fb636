"""A kept tree's sleeping GPU state kept on its GPU while its job waits
(``SPSWAP_KEEP_ON_GPU``; spswap.daemon.prewake with ``resident``, spswap.daemon.on_gpu):
woken right after its dump, left there by the epilog of the run it was dumped from and by
the next prolog, only unlocked by the job's next run, and moved back to host memory (a
kept tree as after its dump) when another job's slot reservation is granted on its GPU,
also one granted while it was being woken; ended (its image stays) where that move
fails. The CUDA and cgroup calls are stand-ins here (no GPU; the real ones run on a GPU
in tests/engines/test_vllm_serve_gpu.py, fate ``on_gpu``); the daemon state, its locks,
statuses, kept trees, slot table and events are the real ones."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from spswap.config import Config
from spswap.daemon import job_ops, on_gpu, prewake, slot_ops
from spswap.daemon.jobs import JobRecord
from spswap.daemon.state import Context, DaemonState
from spswap.slots.table import SlotTable


def _root(st: DaemonState) -> Context:
    return Context(state=st, peer_uid=0, peer_pid=os.getpid())


@pytest.fixture
def kept_gpu0(kept7: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Job 7's kept tree, its job on GPU 0 of a two-GPU slot table; its CUDA checkpoint
    back to host memory recorded."""
    st, kept, calls, gpus, events = kept7
    table = SlotTable(st.cfg.paths.slots, [0, 1])
    monkeypatch.setattr(st, "slot_table", lambda: table)
    st.jobs.put(JobRecord(job_id="7", uid=os.getuid(), user="u", gpus=[0]))

    def put_back_kept(image: Any, pid: int) -> dict[str, float]:
        calls.append("cuda_checkpoint")
        return {"cuda_checkpoint": 0.4}

    monkeypatch.setattr(on_gpu, "put_back_kept", put_back_kept)
    return st, kept, calls, events


MOVED = "its GPU state went back to host memory (kept as after its dump)"
WOKEN = ["thaw", "cuda_restore unlock=False", "freeze"]
MOVED_OFF = ["thaw", "cuda_checkpoint", "freeze"]


def test_keep_on_gpu_is_a_yes_no_setting_off_by_default() -> None:
    assert Config.from_env({}).keep_on_gpu is False
    assert Config.from_env({"SPSWAP_KEEP_ON_GPU": "1"}).keep_on_gpu is True


def test_a_kept_dump_wakes_its_tree_onto_its_gpu_only_where_the_setting_is_on(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dump thread's end (ckpt_dump._dump_locked), the dump itself stood in for: a
    kept tree's wake onto its GPU is asked for with SPSWAP_KEEP_ON_GPU=1 only, after the
    job's lock is let go."""
    from spswap.daemon import ckpt_dump, lifecycle

    woken: list[tuple[str, bool, bool]] = []
    monkeypatch.setattr(ckpt_dump.prewake, "wake_early", lambda st, job_id, **kw: woken.append(
        (job_id, kw.get("resident", False), st.job_locks.of(job_id).locked())))  # fmt: skip

    def dumped_and_kept(st: Any, job_id: str, *a: Any) -> tuple[bool, None]:
        a[-1].kept = True  # (the _LeaveJob: the tree was kept)
        return True, None

    monkeypatch.setattr(ckpt_dump, "_dump", dumped_and_kept)
    for on in ("0", "1"):
        cfg = Config.from_env({"SPSWAP_KEEP_ON_GPU": on}, root=tmp_path / f"root{on}")
        lifecycle.prepare_dirs(cfg)
        st = DaemonState(cfg)
        st.job_locks.of("7").acquire()  # (op_checkpoint's, released by the dump thread)
        ckpt_dump._dump_locked(st, "7", os.getpid(), None, None, False)  # type: ignore[arg-type]
    assert woken == [("7", True, False)]


def test_woken_after_its_dump_it_stays_past_its_runs_epilog_and_hold_time(
    kept_gpu0: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    st, kept, calls, events = kept_gpu0
    monkeypatch.setattr(prewake, "HOLD_S", 0.05)  # (a tree woken at a prolog: ended by then)
    assert prewake.wake_early(st, "7", resident=True)
    assert calls == ["thaw", "cuda_restore unlock=False", "freeze"]
    assert kept.resident and kept.gpu_back_s is not None and st.kept.resident() == [kept]
    assert [(k, f["gpus"]) for k, f in events] == [("kept.on_gpu", [0])]  # (on which GPU)
    assert st.statuses.read("7")["on_gpu"] is True  # (`spswap status`: "kept alive on its GPU")
    # the epilog of the run it was dumped from (its job requeued): it waits for the next run
    job_ops.op_job_end(_root(st), {"job_id": "7", "requeued": True})
    time.sleep(0.2)
    assert st.kept.has("7") and "kill" not in calls
    # the next run's prolog: nothing to wake again; its restore then only unlocks
    assert not prewake.wake_early(st, "7")
    assert calls == ["thaw", "cuda_restore unlock=False", "freeze"]


def test_not_kept_on_a_gpu_where_another_job_holds_a_slot(kept_gpu0: Any) -> None:
    st, kept, calls, events = kept_gpu0
    st.slot_table().reserve(model="m", units=1, allowed_gpus=[0], holder=_holder("8"),
                            timeout_s=1)  # fmt: skip
    assert not prewake.wake_early(st, "7", resident=True)
    assert calls == [] and st.kept.has("7") and not kept.resident, "kept in host memory"
    assert [(k, f["reason"]) for k, f in events] == [
        ("kept.not_on_gpu", "job(s) 8 hold slots on its GPUs")]  # fmt: skip


def test_a_slot_granted_while_it_was_woken_moves_it_off_the_gpu(
    kept_gpu0: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grant came after the check before the wake: checked again as it is kept."""
    st, kept, calls, events = kept_gpu0
    real_wake = prewake.wake_kept

    def wake_then_granted(*a: Any, **kw: Any) -> dict[str, float]:
        st.slot_table().reserve(model="m", units=4, allowed_gpus=[0], holder=_holder("8"),
                                timeout_s=1)  # fmt: skip
        return real_wake(*a, **kw)

    monkeypatch.setattr(prewake, "wake_kept", wake_then_granted)
    assert not prewake.wake_early(st, "7", resident=True)
    assert calls == WOKEN + MOVED_OFF
    assert st.kept.has("7") and not kept.resident and kept.gpu_back_s is None
    moved = [f["reason"] for k, f in events if k == "kept.off_gpu"]
    assert moved == [f"job(s) 8 hold slots on its GPUs: {MOVED}"]
    status = st.statuses.read("7")
    assert status["kept"] is True and status["on_gpu"] is False
    # kept as after its dump (while job 8 holds its slot there, its next run restores the
    # GPU state itself: no early wake beside another job's slot)
    assert not prewake.wake_early(st, "7") and st.kept.has("7")


def test_another_jobs_reservation_on_its_gpu_moves_it_off_its_own_and_other_gpus_do_not(
    kept_gpu0: Any,
) -> None:
    st, kept, calls, events = kept_gpu0
    assert prewake.wake_early(st, "7", resident=True)
    for job_id, gpu in (("7", 0), ("9", 1)):  # its own run's; another job on GPU 1
        st.jobs.put(JobRecord(job_id=job_id, uid=os.getuid(), user="u", gpus=[gpu]))
        slot_ops.op_slots_reserve(_root(st), {"model": "m", "units": 1, "job_id": job_id,
                                              "allowed_gpus": [gpu], "timeout_s": 1})  # fmt: skip
    assert st.kept.has("7") and "kill" not in calls
    st.jobs.put(JobRecord(job_id="8", uid=os.getuid(), user="u", gpus=[0]))
    slot_ops.op_slots_reserve(_root(st), {"model": "m", "units": 1, "job_id": "8",
                                          "allowed_gpus": [0], "timeout_s": 1})  # fmt: skip
    # (moved off in a thread)
    moved = _wait(lambda: [f["reason"] for k, f in events if k == "kept.off_gpu"])
    assert moved == [f"job 8 reserved a slot on its GPU: {MOVED}"]
    assert calls == WOKEN + MOVED_OFF and st.kept.has("7") and not kept.resident
    assert st.statuses.read("7")["kept"] is True and st.statuses.read("7")["on_gpu"] is False


def test_a_slot_granted_just_after_it_was_kept_moves_it_off_once_the_wake_lets_go(
    kept_gpu0: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Granted after the check as it was kept, while the wake still holds the job's lock:
    make_way's move waits for that lock (it gave up at once before, leaving the tree on
    the GPU beside the new slot)."""
    st, kept, calls, events = kept_gpu0
    real_add_unless = st.kept.add_unless

    def add_then_granted(*a: Any, **kw: Any) -> Any:
        reason = real_add_unless(*a, **kw)
        st.jobs.put(JobRecord(job_id="8", uid=os.getuid(), user="u", gpus=[0]))
        slot_ops.op_slots_reserve(_root(st), {"model": "m", "units": 1, "job_id": "8",
                                              "allowed_gpus": [0], "timeout_s": 1})  # fmt: skip
        return reason

    monkeypatch.setattr(st.kept, "add_unless", add_then_granted)
    assert prewake.wake_early(st, "7", resident=True)
    moved = _wait(lambda: [f["reason"] for k, f in events if k == "kept.off_gpu"])
    assert moved == [f"job 8 reserved a slot on its GPU: {MOVED}"]
    assert calls == WOKEN + MOVED_OFF and st.kept.has("7") and not kept.resident


def test_a_move_off_that_fails_ends_it_and_one_under_its_restore_waits(
    kept_gpu0: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    st, kept, calls, events = kept_gpu0
    assert prewake.wake_early(st, "7", resident=True)
    with st.job_locks.of("7"):  # its run's restore owns it: that run takes the memory
        assert not on_gpu.move_off(st, "7", "job 8 reserved a slot on its GPU", wait_s=0.05)
    assert kept.resident and calls == WOKEN

    def fails(image: Any, pid: int) -> dict[str, float]:
        raise RuntimeError("cuda-checkpoint said no")

    monkeypatch.setattr(on_gpu, "put_back_kept", fails)
    assert not on_gpu.move_off(st, "7", "job 8 reserved a slot on its GPU")
    assert not st.kept.has("7") and calls[-2:] == ["kill", "remove"]
    ended = [f["reason"] for k, f in events if k == "kept.ended"]
    assert ended == ["job 8 reserved a slot on its GPU, where its GPU state was kept, and that "
                     "state could not go back to host memory (cuda-checkpoint said no): its "
                     "next run restores from the image"]  # fmt: skip
    assert (st.cfg.paths.images / kept.key).is_dir(), "the image is the way back"
    assert st.statuses.read("7")["kept"] is False and st.statuses.read("7")["on_gpu"] is False


def test_a_restore_that_fails_before_taking_it_ends_it(kept_gpu0: Any) -> None:
    """Its run starts cold then, and needs that GPU memory."""
    from spswap.daemon.ckpt_restore import op_restore
    from spswap.errors import SpswapError

    st, kept, calls, _ = kept_gpu0
    assert prewake.wake_early(st, "7", resident=True)
    with pytest.raises(SpswapError, match="identity incomplete"):
        op_restore(Context(peer_uid=os.getuid(), peer_pid=os.getpid(), state=st),
                   {"job_id": "7"})  # fmt: skip
    assert not st.kept.has("7") and calls[-2:] == ["kill", "remove"]


def _holder(job_id: str) -> Any:
    from spswap.liveness import Holder, pid_start_time

    return Holder(pid=os.getpid(), pid_start=pid_start_time(os.getpid()), uid=os.getuid(),
                  job_id=job_id, since=time.time())  # fmt: skip


def _wait(check: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, "not done in time"
        time.sleep(0.01)
    return found
