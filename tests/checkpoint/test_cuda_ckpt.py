"""CUDA checkpoint: the pure parts here; the driver calls run on a GPU machine only."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from spswap.checkpoint import cuda_ckpt
from spswap.errors import CheckpointFailed

A = "GPU-0a1b2c3d-0000-1111-2222-333344445555"
B = "GPU-ffffffff-0000-1111-2222-333344445555"
C = "GPU-12345678-9abc-def0-1234-56789abcdef0"
D = "GPU-00000000-0000-0000-0000-000000000001"


def test_uuid_round_trip() -> None:
    raw = cuda_ckpt.uuid_bytes(A)
    assert len(raw) == 16 and raw[:4] == bytes.fromhex("0a1b2c3d")
    assert cuda_ckpt.uuid_text(raw) == A
    assert cuda_ckpt.uuid_bytes(A.removeprefix("GPU-").upper()) == raw
    with pytest.raises(ValueError, match="not a GPU UUID"):
        cuda_ckpt.uuid_bytes("GPU-1234")
    with pytest.raises(ValueError, match="16 bytes"):
        cuda_ckpt.uuid_text(b"\x00" * 15)


@pytest.mark.parametrize(
    ("visible", "mapping", "expected"),
    [
        ([A, B, C], {}, [(A, A), (B, B), (C, C)]),
        ([A, B, C], {A: B}, [(A, B), (B, A), (C, C)]),
        ([A, B, C], {A: C, C: A}, [(A, C), (B, B), (C, A)]),
        ([A, B, C, D], {A: B, B: C}, [(A, B), (B, C), (C, A), (D, D)]),
        ([A], {A: A}, [(A, A)]),
        ([A, B], {A.lower().removeprefix("GPU-"): B}, [(A, B), (B, A)]),
    ],
)
def test_gpu_pairs_cover_every_visible_gpu(
    visible: list[str], mapping: dict[str, str], expected: list[tuple[str, str]]
) -> None:
    pairs = cuda_ckpt.gpu_pairs(visible, mapping)
    assert pairs == expected
    assert sorted(o for o, _ in pairs) == sorted(visible)  # every GPU once as old
    assert sorted(n for _, n in pairs) == sorted(visible)  # and once as new


@pytest.mark.parametrize(
    ("visible", "mapping", "message"),
    [
        ([A, B], {C: A}, "not one of the GPUs"),
        ([A, B], {A: C}, "not one of the GPUs"),
        ([A, B, C], {A: C, B: C}, "same GPU"),
        ([A, A], {}, "duplicate"),
    ],
)
def test_gpu_pairs_reject(visible: list[str], mapping: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cuda_ckpt.gpu_pairs(visible, mapping)


def test_cuda_pids_from_open_device_files(tmp_path: Path) -> None:
    for pid, targets in {1: ["/dev/null"], 2: ["/dev/nvidiactl", "/dev/nvidia0"], 3: []}.items():
        (tmp_path / str(pid) / "fd").mkdir(parents=True)
        for fd, target in enumerate(targets):
            os.symlink(target, tmp_path / str(pid) / "fd" / str(fd))
    assert cuda_ckpt.cuda_pids([1, 2, 3, 4], tmp_path) == [2]


def test_process_tree_pids_of_this_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert cuda_ckpt.process_tree_pids(os.getpid())[0] == os.getpid()
        assert child.pid in cuda_ckpt.process_tree_pids(os.getpid())
    finally:
        child.kill()
        child.wait()


def test_each_process_of_a_tree_is_moved_at_once_and_every_failure_waits_for_the_rest() -> None:
    """The driver calls of a tree's processes run side by side (a multi-model job's
    engines restore in the time of the slowest); a failure is raised only once every
    call has returned, and the others' times are still recorded."""
    import threading
    import time

    running, most, lock = [0], [0], threading.Lock()
    finished: list[int] = []

    def call(pid: int) -> None:
        if pid == 2:  # fails at once, while the others are still at work
            raise CheckpointFailed("cuCheckpointProcessRestore of pid 2 failed")
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
            finished.append(pid)

    spent: dict[str, float] = {}
    cuda_ckpt._each([1, 3], call, "restore", spent)
    assert most[0] == 2 and sorted(spent) == ["restore_pid1", "restore_pid3"]
    spent.clear()
    finished.clear()
    with pytest.raises(CheckpointFailed, match="pid 2"):
        cuda_ckpt._each([1, 2, 3], call, "restore", spent)
    # raised only once the others were done (none still running when the caller cleans up)
    assert sorted(finished) == [1, 3] and sorted(spent) == ["restore_pid1", "restore_pid3"]
    cuda_ckpt._each([], call, "restore", spent)  # a tree without CUDA processes


def test_a_tree_whose_checkpoint_fails_for_one_process_runs_again_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two engines checkpoint side by side and one fails: the one already checkpointed
    gets its GPU state back and both are unlocked, so the tree the dump resumes does not
    hang in its next CUDA call. (The driver cannot run here: its calls are stood in for by
    a state table; the GPU test above runs the real ones.)"""
    states = {11: "RUNNING", 12: "RUNNING"}
    calls: list[tuple[str, int]] = []

    def step(name: str, before: str, after: str, fail_pid: int | None = None):  # noqa: ANN202
        def do(pid: int, *_: object) -> None:
            calls.append((name, pid))
            if pid == fail_pid:
                raise CheckpointFailed(f"{name} of pid {pid} failed")
            assert states[pid] == before, (name, pid, states)
            states[pid] = after

        return do

    monkeypatch.setattr(cuda_ckpt, "_driver", lambda: None)
    monkeypatch.setattr(cuda_ckpt, "process_tree_pids", lambda root: [10, 11, 12])
    monkeypatch.setattr(cuda_ckpt, "cuda_pids", lambda pids: [p for p in pids if p in states])
    monkeypatch.setattr(cuda_ckpt, "get_state", lambda pid: states[pid])
    monkeypatch.setattr(cuda_ckpt, "lock", step("lock", "RUNNING", "LOCKED"))
    monkeypatch.setattr(cuda_ckpt, "checkpoint", step("checkpoint", "LOCKED", "CHECKPOINTED", 12))
    monkeypatch.setattr(cuda_ckpt, "restore", step("restore", "CHECKPOINTED", "LOCKED"))
    monkeypatch.setattr(cuda_ckpt, "unlock", step("unlock", "LOCKED", "RUNNING"))
    with pytest.raises(CheckpointFailed, match="checkpoint of pid 12 failed"):
        cuda_ckpt.checkpoint_tree(10)
    assert states == {11: "RUNNING", 12: "RUNNING"}, calls
    assert ("restore", 11) in calls and ("restore", 12) not in calls, calls


def test_unavailable_is_explained_not_crashed() -> None:
    if cuda_ckpt.available():
        pytest.skip("CUDA checkpoint is available here: covered by the GPU test")
    reason = cuda_ckpt.unavailable_reason()
    assert reason and ("cuda-bindings" in reason or "driver" in reason or "cuInit" in reason)
    with pytest.raises(CheckpointFailed, match="not available"):
        cuda_ckpt.get_state(os.getpid())
    with pytest.raises(CheckpointFailed, match="not available"):
        cuda_ckpt.checkpoint_tree(os.getpid())


GPU_CHILD = """
import sys, torch
x = torch.arange(1 << 20, device="cuda", dtype=torch.float64)
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
print(float(x.sum()), flush=True)
"""


@contextlib.contextmanager
def _gpu_child() -> Iterator[subprocess.Popen]:
    """A process with GPU memory (GPU_CHILD), ready; killed afterwards."""
    proc = subprocess.Popen(
        [sys.executable, "-c", GPU_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _computes_as_before(proc: subprocess.Popen) -> None:
    assert proc.stdout is not None and proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert float(proc.stdout.readline()) == float(sum(range(1 << 20)))


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_ckpt.available(), reason=f"{cuda_ckpt.unavailable_reason()}")
def test_checkpoint_and_restore_a_real_cuda_process() -> None:
    with _gpu_child() as proc:
        assert cuda_ckpt.get_state(proc.pid) == "RUNNING"
        assert cuda_ckpt.checkpoint_tree(proc.pid) == [proc.pid]
        assert cuda_ckpt.get_state(proc.pid) == "CHECKPOINTED"
        assert cuda_ckpt.cuda_pids([proc.pid]) == []  # the GPU files are released
        uuids = cuda_ckpt.visible_gpu_uuids()
        gpu_map = {uuids[0]: uuids[0]}  # exercise gpuPairs even on one GPU
        assert cuda_ckpt.restore_tree(proc.pid, gpu_map) == [proc.pid]
        assert cuda_ckpt.unlock_tree(proc.pid) == [proc.pid]
        assert cuda_ckpt.get_state(proc.pid) == "RUNNING"
        _computes_as_before(proc)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_ckpt.available(), reason=f"{cuda_ckpt.unavailable_reason()}")
def test_a_restored_locked_process_goes_back_to_host_memory_and_runs_after_a_restore() -> None:
    """What SPSWAP_KEEP_ON_GPU's move off the GPU does (spswap.daemon.on_gpu): a process
    restored and left LOCKED is checkpointed again without an unlock between, then
    restored and unlocked, and computes as before."""
    with _gpu_child() as proc:
        assert cuda_ckpt.checkpoint_tree(proc.pid) == [proc.pid]
        assert cuda_ckpt.restore_tree(proc.pid) == [proc.pid]
        assert cuda_ckpt.get_state(proc.pid) == "LOCKED"
        spent: dict[str, float] = {}
        assert cuda_ckpt.checkpoint_locked([proc.pid], spent) == [proc.pid]
        assert cuda_ckpt.get_state(proc.pid) == "CHECKPOINTED" and list(spent) == [
            f"checkpoint_pid{proc.pid}"]  # fmt: skip
        assert cuda_ckpt.restore_tree(proc.pid) == [proc.pid]
        assert cuda_ckpt.unlock_tree(proc.pid) == [proc.pid]
        _computes_as_before(proc)


def test_checkpoint_locked_takes_only_locked_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """(The driver's states stood in for by a table: the GPU test above runs the real ones.)"""
    states = {11: "LOCKED", 12: "RUNNING", 13: "LOCKED"}
    done: list[int] = []

    def checkpoint(pid: int) -> None:
        assert states[pid] == "LOCKED"
        states[pid] = "CHECKPOINTED"
        done.append(pid)

    monkeypatch.setattr(cuda_ckpt, "_driver", lambda: None)
    monkeypatch.setattr(cuda_ckpt, "get_state", lambda pid: states[pid])
    monkeypatch.setattr(cuda_ckpt, "checkpoint", checkpoint)
    assert cuda_ckpt.checkpoint_locked([11, 12, 13]) == [11, 13]
    assert sorted(done) == [11, 13] and states[12] == "RUNNING"


GPU_PARENT = """
import subprocess, sys
children = [subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True) for _ in range(2)]
for c in children:
    assert c.stdout.readline().strip() == "ready"
print("ready", flush=True)
sys.stdin.readline()
for c in children:
    c.stdin.write("\\n"); c.stdin.flush()
    print(c.stdout.readline().strip(), flush=True)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_ckpt.available(), reason=f"{cuda_ckpt.unavailable_reason()}")
def test_a_tree_of_two_cuda_processes_is_checkpointed_and_restored_side_by_side() -> None:
    """Two engines in one tree (as `spswap serve --models`): both checkpointed, restored
    (at once) and unlocked, and both compute the same after."""
    proc = subprocess.Popen([sys.executable, "-c", GPU_PARENT, GPU_CHILD],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        spent: dict[str, float] = {}
        pids = cuda_ckpt.checkpoint_tree(proc.pid, spent_s=spent)
        assert len(pids) == 2 and proc.pid not in pids, pids
        assert {cuda_ckpt.get_state(p) for p in pids} == {"CHECKPOINTED"}
        assert sorted(cuda_ckpt.restore_tree(proc.pid, spent_s=spent)) == sorted(pids)
        assert sorted(cuda_ckpt.unlock_tree(proc.pid)) == sorted(pids)
        assert sorted(spent) == sorted(
            f"{w}_pid{p}" for w in ("checkpoint", "restore") for p in pids
        )
        proc.stdin.write("\n")
        proc.stdin.flush()
        expected = float(sum(range(1 << 20)))
        assert [float(proc.stdout.readline()) for _ in pids] == [expected, expected]
    finally:
        for pid in cuda_ckpt.process_tree_pids(proc.pid):
            if pid != proc.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
        proc.kill()
        proc.wait()
