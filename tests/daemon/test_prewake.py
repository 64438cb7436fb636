"""A kept tree's GPU state woken early, at its job's prolog (spswap.daemon.prewake): when
it is done and when not, the order of its steps, the restore that then only unlocks, and
the end of a tree its run never took. The CUDA calls are stand-ins here (no GPU: they
run on the H200, tests/engines/test_vllm_serve_gpu.py and `scripts/gpu/turns.sh`); the
daemon state, its locks, statuses, kept trees and events are the real ones."""

from __future__ import annotations

import os
from typing import Any

import pytest

from spswap.daemon import job_ops, prewake
from spswap.daemon.kept import Kept
from spswap.daemon.state import DaemonState


def test_refusal_says_why_not() -> None:
    ok = {"dumped_gpus": ["GPU-a"], "cuda_pids": [5], "job_gpus": ["GPU-a"], "shared_with": []}
    assert prewake.refusal(**ok) is None  # type: ignore[arg-type]
    cases = [
        ({"cuda_pids": []}, "no GPU state to restore"),
        ({"job_gpus": []}, "the job's GPUs are not known"),
        ({"dumped_gpus": []}, "the job's GPUs are not known"),
        ({"job_gpus": ["GPU-b"]},
         "the job is on other GPUs than its dump (the restore remaps them)"),
        ({"dumped_gpus": ["GPU-a", "GPU-b"], "job_gpus": ["GPU-b", "GPU-a"]},
         "the job is on other GPUs than its dump (the restore remaps them)"),
        ({"shared_with": ["12", "9"]}, "job(s) 12, 9 hold slots on its GPUs"),
    ]  # fmt: skip
    for change, why in cases:
        assert prewake.refusal(**{**ok, **change}) == why, change  # type: ignore[arg-type]


def test_woken_early_then_the_restore_only_unlocks(
    kept7: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    st, kept, calls, _, events = kept7
    assert prewake.wake_early(st, "7")
    assert calls == ["thaw", "cuda_restore unlock=False", "freeze"]
    assert kept.gpu_back_s is not None and kept.early_timings["cuda_restore"] == 0.5
    assert st.kept.has("7"), "back among the kept trees, for the run's restore"
    assert [k for k, _ in events] == ["restore.woken_early"]
    # the run's restore: the CUDA restore is not done again, only the unlock
    from spswap.daemon import ckpt_restore

    monkeypatch.setattr(ckpt_restore, "kept_image", lambda root, **kw: root / kept.key)
    monkeypatch.setattr(ckpt_restore, "wake_kept", lambda *a, **kw: calls.append("again"))
    monkeypatch.setattr(
        ckpt_restore,
        "unlock_kept",
        lambda image, pid: (calls.append("unlock"), {"cuda_unlock": 0.001})[1],
    )
    monkeypatch.setattr(type(kept.parking), "take_device_rules", lambda self, like: None,
                        raising=False)  # fmt: skip
    rec = st.jobs.get("7")
    woken = ckpt_restore._wake_kept(st, rec, "7", None, st.kept.take("7"),  # type: ignore[arg-type]
                                    ckpt_restore.Asker.of(os.getpid()))  # fmt: skip
    assert woken is not None and calls[3:] == ["thaw", "unlock"]
    assert woken[1]["early_cuda_restore"] == 0.5 and woken[1]["cuda_unlock"] == 0.001


def test_not_woken_on_other_gpus_or_while_its_job_is_locked(kept7: Any) -> None:
    st, kept, calls, gpus, _ = kept7
    gpus["now"] = ["GPU-b"]
    assert not prewake.wake_early(st, "7")
    gpus["now"] = ["GPU-a"]
    with st.job_locks.of("7"):  # a dump or the run's restore
        assert not prewake.wake_early(st, "7")
    assert calls == [] and kept.gpu_back_s is None and st.kept.has("7")


def test_a_tree_woken_early_and_never_taken_is_ended_at_its_jobs_end(kept7: Any) -> None:
    st, kept, calls, _, events = kept7
    assert not prewake.end_if_untaken(st, "7"), "not woken early: it stays kept"
    assert st.kept.has("7")
    assert prewake.wake_early(st, "7")
    assert not prewake.end_if_untaken(st, "7", woken_s=kept.gpu_back_s - 1), "another wake's"
    job_ops.op_job_end(_root_ctx(st), {"job_id": "7", "requeued": True})
    assert not st.kept.has("7") and calls[-2:] == ["kill", "remove"]
    ended = [f for k, f in events if k == "kept.ended"]
    assert ended and "restored early for its job's run, which did not take it" in \
        ended[0]["reason"]  # fmt: skip
    assert st.statuses.read("7")["kept"] is False


def test_a_failed_early_wake_ends_the_tree_its_image_stays(
    kept7: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    st, kept, calls, _, events = kept7

    def fails(*a: Any, **kw: Any) -> dict[str, float]:
        raise RuntimeError("cuda-checkpoint said no")

    monkeypatch.setattr(prewake, "wake_kept", fails)
    assert not prewake.wake_early(st, "7")
    assert not st.kept.has("7") and "kill" in calls
    assert (st.cfg.paths.images / kept.key).is_dir()
    ended = [f for k, f in events if k == "kept.ended"]
    assert ended[0]["reason"] == ("its early wake failed (cuda-checkpoint said no): its next "
                                  "run restores from the image")  # fmt: skip


def _root_ctx(st: DaemonState) -> Any:
    from spswap.daemon.state import Context

    return Context(state=st, peer_uid=0, peer_pid=1)


def test_a_failure_before_the_thaw_leaves_the_tree_kept(
    kept7: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    st, kept, calls, _, events = kept7

    def no_driver(st: Any, job_id: str) -> list[str]:
        raise OSError("NVML is not answering")

    monkeypatch.setattr(prewake, "run_gpu_uuids", no_driver)
    assert not prewake.wake_early(st, "7")
    assert calls == [] and st.kept.has("7") and kept.gpu_back_s is None
    assert [k for k, _ in events] == []


def test_a_run_on_other_gpus_gets_the_image_not_the_early_tree(
    kept7: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registered again on other GPUs (no epilog between): the tree woken early on the old
    ones is ended, and the restore goes on from the image (never unlocked there)."""
    from spswap.daemon import ckpt_restore

    st, kept, calls, gpus, events = kept7
    assert prewake.wake_early(st, "7")
    gpus["now"] = ["GPU-b"]
    monkeypatch.setattr(ckpt_restore, "kept_image", lambda root, **kw: root / kept.key)
    monkeypatch.setattr(ckpt_restore, "unlock_kept", lambda *a: calls.append("unlock"))
    monkeypatch.setattr(type(kept.parking), "take_device_rules", lambda self, like: None,
                        raising=False)  # fmt: skip
    woken = ckpt_restore._wake_kept(
        st,
        st.jobs.get("7"),
        "7",
        None,  # type: ignore[arg-type]
        st.kept.take("7"),
        ckpt_restore.Asker.of(os.getpid()),
    )
    assert woken is None and "unlock" not in calls and calls[-2:] == ["kill", "remove"]
    ended = [f["reason"] for k, f in events if k == "kept.ended"]
    assert ended == ["its GPU state was restored early on GPUs its run does not have: "
                     "restored from its image"]  # fmt: skip
    assert (st.cfg.paths.images / kept.key).is_dir(), "the image is the way back"


def test_a_restore_that_fails_before_taking_the_tree_ends_it_only_for_its_own_job(
    kept7: Any,
) -> None:
    """Its run starts cold then, and needs the GPU memory the early tree holds; another
    user's failed call for the job (refused) must not end it."""
    import os

    from spswap.daemon.ckpt_restore import op_restore
    from spswap.daemon.jobs import JobRecord
    from spswap.daemon.state import Context
    from spswap.errors import SpswapError

    st, kept, calls, _, events = kept7
    st.jobs.put(JobRecord(job_id="7", uid=os.getuid(), user="u", gpus=[0]))
    assert prewake.wake_early(st, "7")
    with pytest.raises(SpswapError):  # someone else's call: refused, the tree stays
        op_restore(Context(peer_uid=os.getuid() + 1, peer_pid=os.getpid(), state=st),
                   {"job_id": "7"})  # fmt: skip
    assert st.kept.has("7")
    with pytest.raises(SpswapError, match="identity incomplete"):  # the job's own, failing
        op_restore(Context(peer_uid=os.getuid(), peer_pid=os.getpid(), state=st),
                   {"job_id": "7"})  # fmt: skip
    assert not st.kept.has("7") and calls[-2:] == ["kill", "remove"]


def _wait_woken(kept: Kept, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while kept.early_timings is None:
        assert time.monotonic() < deadline, "the wake did not come"
        time.sleep(0.01)


def test_a_runs_start_wakes_its_kept_tree_once(kept7: Any) -> None:
    """``job.starting`` (sent by `spswap serve` before its imports): the kept tree wakes
    early where nothing woke it; a second start, or the prolog's wake after it, does
    nothing (a second CUDA restore of a restored tree would fail and end it)."""
    import os

    from spswap.daemon.jobs import JobRecord
    from spswap.daemon.state import Context

    st, kept, calls, _, events = kept7
    st.jobs.put(JobRecord(job_id="7", uid=os.getuid(), user="u", gpus=[0]))
    ctx = Context(peer_uid=os.getuid(), peer_pid=os.getpid(), state=st)
    assert job_ops.op_job_starting(ctx, {"job_id": "7"})["waking"] is True
    _wait_woken(kept)
    assert calls == ["thaw", "cuda_restore unlock=False", "freeze"]
    assert job_ops.op_job_starting(ctx, {"job_id": "7"})["waking"] is False
    assert not prewake.wake_early(st, "7"), "woken already"
    assert calls == ["thaw", "cuda_restore unlock=False", "freeze"] and st.kept.has("7")
    starts = [f for k, f in events if k == "job.starting"]
    assert [f["waking"] for f in starts] == [True, False] and starts[0]["pid"] == os.getpid()


def test_a_runs_start_registers_a_run_no_prolog_registered(
    kept7: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """slurmd ran no prolog for the requeued run (the record says its last run ended):
    its start registers it, once Slurm says it runs here as its user, and wakes it."""
    import os

    from spswap.daemon.jobs import JobRecord, JobState
    from spswap.daemon.state import Context
    from spswap.errors import CheckpointFailed, PermissionDenied, RequestRefused
    from spswap.slurm.parse import JobInfo

    st, kept, calls, _, events = kept7
    ctx = Context(peer_uid=os.getuid(), peer_pid=os.getpid(), state=st)
    with pytest.raises(RequestRefused, match="job 7 is not registered on this node"):
        job_ops.op_job_starting(ctx, {"job_id": "7"})
    st.jobs.put(JobRecord(job_id="7", uid=os.getuid(), user="u", gpus=[0], restart_count=0,
                          state=JobState.REQUEUED))  # fmt: skip
    st.node_names.add("gpu07")
    slurm: dict[str, Any] = {"info": None}
    monkeypatch.setattr(st, "ask_slurm", lambda job_id: (slurm["info"], True))
    with pytest.raises(CheckpointFailed, match="Slurm does not say a new run of it runs here"):
        job_ops.op_job_starting(ctx, {"job_id": "7"})
    with pytest.raises(PermissionDenied):
        job_ops.op_job_starting(Context(peer_uid=os.getuid() + 1, peer_pid=1, state=st),
                                {"job_id": "7"})  # fmt: skip
    assert calls == [] and kept.early_timings is None
    slurm["info"] = JobInfo(job_id="7", state="RUNNING", restart_count=1, uid=os.getuid(),
                            nodes="gpu07", gpus=(0,))  # fmt: skip
    assert job_ops.op_job_starting(ctx, {"job_id": "7"}) == {
        "job_id": "7", "restart_count": 1, "waking": True}  # fmt: skip
    _wait_woken(kept)
    assert calls == ["thaw", "cuda_restore unlock=False", "freeze"]
    started = [f for k, f in events if k == "job.start"]
    assert started and started[0]["registered_by"].startswith("first request")
