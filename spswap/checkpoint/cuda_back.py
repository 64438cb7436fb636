"""A tree's GPU state back from its CUDA checkpoint: CUDA restore (remapped onto other
GPUs where the run that takes it back has them), then unlock.

A restored CUDA process stays LOCKED (its CUDA calls wait) until it is unlocked, so the
two steps can be apart: a kept tree's GPU state may be restored early, at its job's
prolog, while its run's ``spswap serve`` is still starting, and unlocked when the run
takes it back (:mod:`spswap.daemon.prewake`). The image's CUDA record
(:data:`CUDA_RECORD`, written at the dump) says which processes had GPU state and on
which GPUs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from spswap.checkpoint import cuda_ckpt
from spswap.checkpoint.gpu_map import remap
from spswap.errors import CheckpointFailed
from spswap.fsutil import read_json

CUDA_RECORD = "spswap-cuda.json"


def cuda_record(image: Path) -> dict[str, Any]:
    """The image's CUDA record (``cuda_pids``, ``gpu_uuids``); empty when it has none."""
    return read_json(image / CUDA_RECORD) or {}


def gpu_map_for(record: dict[str, Any], gpu_uuids: list[str] | None) -> dict[str, str] | None:
    """Old GPU UUID -> new, when the tree had CUDA processes and the run that takes it
    back is on other GPUs than the dump recorded (:func:`remap` refuses another count)."""
    if record.get("cuda_pids") and gpu_uuids and record.get("gpu_uuids"):
        return remap(record["gpu_uuids"], gpu_uuids)
    return None


def cuda_back(pid: int, cuda: list[int], gpu_map: dict[str, str] | None, *,
              unlock: bool = True) -> dict[str, float]:  # fmt: skip
    """CUDA restore (then unlock, unless ``unlock`` is False) of the tree's ``cuda``
    processes; their timings."""
    timings: dict[str, float] = {}
    if cuda:
        t0 = time.monotonic()
        per_process: dict[str, float] = {}
        cuda_ckpt.restore_tree(pid, gpu_map=gpu_map, pids=cuda, spent_s=per_process)
        timings["cuda_restore"] = time.monotonic() - t0
        timings.update({f"cuda_{k}": v for k, v in per_process.items()})
        if unlock:
            timings.update(unlock_back(pid, cuda))
    return timings


def unlock_back(pid: int, cuda: list[int]) -> dict[str, float]:
    """Unlock the tree's restored ``cuda`` processes (LOCKED -> running); the timing."""
    t0 = time.monotonic()
    cuda_ckpt.unlock_tree(pid, pids=cuda)
    return {"cuda_unlock": time.monotonic() - t0}


def wake_kept(image: Path, pid: int, *, gpu_uuids: list[str] | None = None,
              tree: set[int] | None = None, unlock: bool = True) -> dict[str, float]:  # fmt: skip
    """Give a kept tree (rooted at ``pid``, thawed) its GPU state back: CUDA restore
    (remapped when ``gpu_uuids`` differ from the dump's) and, unless ``unlock`` is False,
    unlock, by the CUDA record of ``image``. The caller deletes the image in any case
    once the tree ran on (best after waking the instance: freeing its pages takes a few
    tenths of a second). On failure the caller ends the tree (its GPU state may be half
    back). ``tree``: the kept tree's processes as the caller found them (its parked
    cgroup): every CUDA process the dump recorded must be among them, so that no process
    that took over a pid since is ever restored onto this job's GPUs."""
    try:
        record = cuda_record(image)
        cuda = list(record.get("cuda_pids", []))
        missing = [p for p in cuda if tree is not None and p not in tree]
        if missing:
            raise CheckpointFailed(f"the instance lost its CUDA process(es) {missing}")
        return cuda_back(pid, cuda, gpu_map_for(record, gpu_uuids), unlock=unlock)
    except CheckpointFailed:
        raise
    except Exception as e:
        raise CheckpointFailed(f"the instance (pid {pid}) could not get its GPU state "
                               f"back: {e}") from None  # fmt: skip


def put_back_kept(image: Path, pid: int) -> dict[str, float]:
    """The GPU state of a kept tree that :func:`wake_kept` restored with ``unlock=False``
    (still LOCKED; the tree thawed) back into its host memory by a CUDA checkpoint, as
    after its dump: the GPU's memory goes back to the driver, and a later
    :func:`wake_kept` restores it again. CheckpointFailed when it cannot (the caller ends
    the tree)."""
    try:
        t0 = time.monotonic()
        per_process: dict[str, float] = {}
        cuda_ckpt.checkpoint_locked(list(cuda_record(image).get("cuda_pids", [])), per_process)
        return {"cuda_checkpoint": time.monotonic() - t0,
                **{f"cuda_{k}": v for k, v in per_process.items()}}  # fmt: skip
    except Exception as e:
        raise CheckpointFailed(f"the instance (pid {pid}) could not give its GPU state back "
                               f"to host memory: {e}") from None  # fmt: skip


def unlock_kept(image: Path, pid: int) -> dict[str, float]:
    """Unlock a kept tree whose GPU state :func:`wake_kept` restored with ``unlock=False``
    (the tree thawed); CheckpointFailed when it cannot (the caller ends the tree)."""
    try:
        return unlock_back(pid, list(cuda_record(image).get("cuda_pids", [])))
    except Exception as e:
        raise CheckpointFailed(f"the instance (pid {pid}) could not be unlocked: {e}"
                               ) from None  # fmt: skip
