"""CUDA checkpoint through the driver API (``cuda.bindings.driver``), no cuda-checkpoint binary.

The sequence around a CRIU dump ("external mode", without CRIU's CUDA plugin):
``checkpoint_tree`` (lock, then checkpoint, every CUDA process of the tree: GPU memory moves
to host memory and the processes drop their /dev/nvidia* files), ``criu dump``; later
``criu restore``, ``restore_tree`` (optionally onto other GPUs), ``unlock_tree``.

Needs driver >= 570; restoring onto other GPUs (``gpuPairs``) needs >= 580 and a pair for
every GPU the driver sees, so the caller must see all of the node's GPUs (run it without
``CUDA_VISIBLE_DEVICES``, as the daemon does). The driver restores only with persistence
mode on or after ``cuInit`` in the caller; :func:`_driver` calls ``cuInit``.

cuda-bindings is imported lazily: this module imports on any machine; :func:`available` says
whether the calls can work here and :func:`unavailable_reason` why not.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import re
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from spswap.checkpoint import proctree
from spswap.errors import CheckpointFailed
from spswap.install_hint import pip_install_hint

DEFAULT_LOCK_TIMEOUT_MS = 10_000
STATE_PREFIX = "CU_PROCESS_STATE_"
_UUID_RE = re.compile(r"^(?:GPU-)?([0-9a-fA-F]{8})-?([0-9a-fA-F]{4})-?([0-9a-fA-F]{4})-?"
                      r"([0-9a-fA-F]{4})-?([0-9a-fA-F]{12})$", re.IGNORECASE)  # fmt: skip


# ---- pure helpers -------------------------------------------------------------------------


def uuid_bytes(text: str) -> bytes:
    """16 raw bytes of a GPU UUID written as NVML/nvidia-smi do (``GPU-xxxxxxxx-xxxx-...``)."""
    m = _UUID_RE.match(text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not a GPU UUID (expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-...)")
    return bytes.fromhex("".join(m.groups()))


def uuid_text(raw: bytes) -> str:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` from 16 raw bytes."""
    if len(raw) != 16:
        raise ValueError(f"a GPU UUID has 16 bytes, got {len(raw)}")
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def gpu_pairs(visible_uuids: Iterable[str], mapping: Mapping[str, str]) -> list[tuple[str, str]]:
    """A (old, new) pair for EVERY visible GPU, honouring ``mapping`` (old -> new).

    The driver wants the pairs to cover every GPU it sees and to be a permutation. GPUs not in
    ``mapping`` keep their place when it is free, and otherwise take the GPUs that the mapping
    freed, in visible order (so ``{A: B}`` on ``[A, B, C]`` gives A->B, B->A, C->C).
    UUIDs are compared in canonical ``GPU-...`` form.
    """
    visible = [uuid_text(uuid_bytes(u)) for u in visible_uuids]
    if len(set(visible)) != len(visible):
        raise ValueError(f"duplicate GPU UUIDs in {visible}")
    canon = {uuid_text(uuid_bytes(o)): uuid_text(uuid_bytes(n)) for o, n in mapping.items()}
    for old, new in canon.items():
        for u in (old, new):
            if u not in visible:
                raise ValueError(f"GPU {u} is not one of the GPUs the driver sees: {visible}")
    if len(set(canon.values())) != len(canon):
        raise ValueError(f"two GPUs map onto the same GPU in {dict(mapping)}")
    taken = set(canon.values())
    pairs = dict(canon)
    rest = [u for u in visible if u not in canon]
    for u in rest:
        if u not in taken:
            pairs[u] = u
            taken.add(u)
    free = [u for u in visible if u not in taken]
    for u in [u for u in rest if u not in pairs]:
        pairs[u] = free.pop(0)
    return [(u, pairs[u]) for u in visible]


def cuda_pids(pids: Iterable[int], proc: Path = proctree.PROC) -> list[int]:
    """The processes among ``pids`` that hold a /dev/nvidia* file open (CUDA users)."""
    return [
        pid for pid in pids
        if any(link.startswith("/dev/nvidia") for link in proctree.fd_links(pid, proc).values())
    ]  # fmt: skip


def process_tree_pids(root_pid: int) -> list[int]:
    """``root_pid`` and its descendants, parents first (from /proc/<pid>/task/*/children)."""
    return proctree.process_tree_pids(root_pid)


# ---- the driver -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _load() -> tuple[Any, str | None]:
    """(the driver module, None) or (None, why not)."""
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found]
    except ImportError:
        return None, f"cuda-bindings is not installed (`{pip_install_hint('gpu')}`)"
    if not hasattr(driver, "cuCheckpointProcessLock"):
        return None, "this cuda-bindings has no cuCheckpointProcess* (needs CUDA 12.8+ bindings)"
    try:
        (err,) = driver.cuInit(0)
    except Exception as e:  # noqa: BLE001 - no driver library at all raises, not returns
        return None, f"no NVIDIA driver here ({type(e).__name__}: {e})"
    if err != driver.CUresult.CUDA_SUCCESS:
        return None, f"cuInit failed: {err.name} (no GPU, or the driver is not loaded)"
    return driver, None


def unavailable_reason() -> str | None:
    """Why CUDA checkpoint cannot run here, or None when it can."""
    return _load()[1]


def available() -> bool:
    """True when cuda-bindings, a driver and a GPU are present."""
    return _load()[0] is not None


def _driver() -> Any:
    driver, reason = _load()
    if driver is None:
        raise CheckpointFailed(f"CUDA checkpoint is not available: {reason}")
    return driver


def _check(result: Any, what: str, pid: int) -> Any:
    driver = _driver()
    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        raise CheckpointFailed(
            f"{what} of pid {pid} failed: {err.name}; check the process state with "
            "`spswap doctor` and the driver version (>= 570, >= 580 for GPU remap)"
        )
    return result[1] if len(result) > 1 else None


def get_state(pid: int) -> str:
    """The CUDA process state: ``RUNNING``, ``LOCKED``, ``CHECKPOINTED``, ``FAILED``, ..."""
    state = _check(_driver().cuCheckpointProcessGetState(pid), "cuCheckpointProcessGetState", pid)
    return str(state.name).removeprefix(STATE_PREFIX)


def lock(pid: int, timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS) -> None:
    """Lock: wait for running CUDA work (up to ``timeout_ms``) and block new work."""
    driver = _driver()
    args = driver.CUcheckpointLockArgs()
    args.timeoutMs = timeout_ms
    _check(driver.cuCheckpointProcessLock(pid, args), "cuCheckpointProcessLock", pid)


def checkpoint(pid: int) -> None:
    """Move a LOCKED process's GPU memory into its host memory and release the GPU."""
    _check(_driver().cuCheckpointProcessCheckpoint(pid, None), "cuCheckpointProcessCheckpoint", pid)


def _cuuuid(driver: Any, text: str) -> Any:
    u = driver.CUuuid()
    # CUuuid.bytes is read-only in the bindings: fill the struct in place.
    ctypes.memmove(u.getPtr(), uuid_bytes(text), 16)
    return u


def visible_gpu_uuids() -> list[str]:
    """UUIDs of every GPU this process's driver sees, in CUDA order."""
    driver = _driver()
    count = _check(driver.cuDeviceGetCount(), "cuDeviceGetCount", 0)
    uuids = []
    for ordinal in range(count):
        dev = _check(driver.cuDeviceGet(ordinal), "cuDeviceGet", 0)
        uuids.append(
            uuid_text(bytes(_check(driver.cuDeviceGetUuid(dev), "cuDeviceGetUuid", 0).bytes))
        )
    return uuids


def restore(pid: int, pairs: list[tuple[str, str]] | None = None) -> None:
    """Bring a CHECKPOINTED process's GPU memory back, onto other GPUs when ``pairs`` says."""
    driver = _driver()
    args = None
    if pairs:
        structs = []
        for old, new in pairs:
            p = driver.CUcheckpointGpuPair()
            p.oldUuid = _cuuuid(driver, old)
            p.newUuid = _cuuuid(driver, new)
            structs.append(p)
        args = driver.CUcheckpointRestoreArgs()
        args.gpuPairs = structs
        args.gpuPairsCount = len(structs)
    _check(driver.cuCheckpointProcessRestore(pid, args), "cuCheckpointProcessRestore", pid)


def unlock(pid: int) -> None:
    """Let a restored (LOCKED) process run CUDA work again."""
    _check(_driver().cuCheckpointProcessUnlock(pid, None), "cuCheckpointProcessUnlock", pid)


def _states(pids: Iterable[int]) -> dict[int, str]:
    out: dict[int, str] = {}
    for pid in pids:
        try:
            out[pid] = get_state(pid)
        except CheckpointFailed:
            continue  # not a CUDA process
    return out


def _each(pids: list[int], call: Callable[[int], None], what: str,
          spent_s: dict[str, float] | None) -> None:  # fmt: skip
    """``call(pid)`` for every pid at once, one thread each: the driver moves each
    process's GPU state on its own (a tree of several engines, one per model, waits for
    the slowest instead of their sum). Each one's time goes into ``spent_s``
    (``<what>_pid<N>``); the first failure is raised once every call has returned, so no
    call is still running when the caller cleans up."""

    def timed(pid: int) -> float:
        t0 = time.monotonic()
        call(pid)
        return time.monotonic() - t0

    with ThreadPoolExecutor(max_workers=max(1, len(pids)),
                            thread_name_prefix=f"cuda-{what}") as ex:  # fmt: skip
        futures = {pid: ex.submit(timed, pid) for pid in pids}
    # (the executor's exit waited for every call)
    failed = [e for f in futures.values() if (e := f.exception()) is not None]
    if spent_s is not None:
        spent_s.update({f"{what}_pid{pid}": f.result() for pid, f in futures.items()
                        if f.exception() is None})  # fmt: skip
    if failed:
        raise failed[0]


def checkpoint_tree(root_pid: int, timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS,
                    spent_s: dict[str, float] | None = None) -> list[int]:  # fmt: skip
    """Lock, then checkpoint, every CUDA process of the tree; returns their pids.

    All are locked before any is checkpointed, so no process waits on a peer that is
    already gone. On failure every one is made to run again (best effort): those already
    checkpointed (their peers checkpoint at the same time) get their GPU state back, and
    all are unlocked, so that the tree the caller resumes does not hang in its next CUDA
    call. ``spent_s`` gets each process's checkpoint time (``checkpoint_pid<N>``).
    """
    _driver()  # a clear reason first when CUDA checkpoint cannot run here
    pids = [p for p, s in _states(cuda_pids(process_tree_pids(root_pid))).items() if s == "RUNNING"]
    locked: list[int] = []
    try:
        for pid in pids:
            lock(pid, timeout_ms)
            locked.append(pid)
        _each(pids, checkpoint, "checkpoint", spent_s)
    except CheckpointFailed:
        for pid in locked:
            with contextlib.suppress(CheckpointFailed):
                if get_state(pid) == "CHECKPOINTED":
                    restore(pid)
                if get_state(pid) == "LOCKED":
                    unlock(pid)
        raise
    return pids


def restore_tree(
    root_pid: int, gpu_map: Mapping[str, str] | None = None, pids: list[int] | None = None,
    spent_s: dict[str, float] | None = None,
) -> list[int]:  # fmt: skip
    """Restore every CHECKPOINTED CUDA process of the tree (they stay LOCKED); returns pids.

    ``gpu_map`` (old UUID -> new UUID) moves them onto other GPUs; pairs are built for every
    GPU the driver sees. ``pids`` defaults to the tree's processes in CHECKPOINTED state
    (after a checkpoint they hold no /dev/nvidia* file, so the state is the only sign).
    ``spent_s`` gets each process's restore time (``restore_pid<N>``).
    """
    _driver()
    candidates = pids if pids is not None else process_tree_pids(root_pid)
    todo = [p for p, s in _states(candidates).items() if s == "CHECKPOINTED"]
    pairs = gpu_pairs(visible_gpu_uuids(), gpu_map) if gpu_map else None
    _each(todo, lambda pid: restore(pid, pairs), "restore", spent_s)
    return todo


def checkpoint_locked(pids: list[int], spent_s: dict[str, float] | None = None) -> list[int]:
    """Checkpoint those of ``pids`` that are LOCKED (restored, not unlocked yet: their GPU
    state goes back into their host memory, as at a dump, and the GPU's memory to the
    driver); returns them. ``spent_s`` as :func:`restore_tree`'s."""
    _driver()
    todo = [p for p, s in _states(pids).items() if s == "LOCKED"]
    _each(todo, checkpoint, "checkpoint", spent_s)
    return todo


def unlock_tree(root_pid: int, pids: list[int] | None = None) -> list[int]:
    """Unlock every LOCKED CUDA process of the tree; returns their pids."""
    _driver()
    candidates = pids if pids is not None else process_tree_pids(root_pid)
    todo = [p for p, s in _states(candidates).items() if s == "LOCKED"]
    for pid in todo:
        unlock(pid)
    return todo
