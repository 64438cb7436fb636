"""The daemon's checkpoint and restore of an instance, in the order the facts demand.

Dump (the instance has already slept: weights out of GPU memory, the pool has them):
  CUDA checkpoint of the small remainder (driver API) -> CRIU dump -> meta.json
  (identity + integrity hash).
Restore:
  identity + integrity check -> CRIU restore -> CUDA restore (+GPU remap) -> unlock;
  the instance then wakes and copies its weights from the pool itself.
Kept (the dump left the tree running, and the daemon froze it outside its job):
  identity check -> (thaw) -> CUDA restore -> unlock; CRIU's restore is skipped and the
  image, stale once the tree ran on, is deleted.

Runs as root inside ``spswapd``. Images live in ``<images_root>/<key>/`` (root-only), keyed by
job and identity; only images this code dumped (they carry spswap's dump record and meta)
are ever restored, and only for the same uid (the uid is part of the identity).
"""

from __future__ import annotations

import functools
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spswap.checkpoint import criu, cuda_ckpt, proctree
from spswap.checkpoint.credentials import (  # noqa: F401 - callers use them from here
    credentials_problem,
    dump_frozen,
    user_groups,
)
from spswap.checkpoint.cuda_back import CUDA_RECORD, cuda_back, gpu_map_for
from spswap.checkpoint.image_creds import image_problem
from spswap.checkpoint.images import (
    Identity,
    image_key,
    read_meta,
    verify_before_restore,
    write_meta,
)
from spswap.errors import CheckpointFailed, CriuNotStarted, ImageRejected
from spswap.fsutil import atomic_write_json, read_json
from spswap.liveness import pid_alive

PREFLIGHT_WAIT_S = 3.0  # the instance closes its daemon connection right after asking


@dataclass
class DumpReport:
    key: str
    path: Path
    size_bytes: int
    cuda_pids: list[int]
    timings_s: dict[str, float] = field(default_factory=dict)
    kept: bool = False  # the tree runs on after the dump (CUDA-checkpointed)

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "path": str(self.path), "size_bytes": self.size_bytes,
                "cuda_pids": self.cuda_pids, "timings_s": self.timings_s,
                "kept": self.kept}  # fmt: skip


def job_image_key(job_id: str, identity: Identity) -> str:
    """``job<id>-<model>-<config>-<identity>``: one image per job and identity."""
    if not re.fullmatch(r"[A-Za-z0-9_.+-]{1,64}", job_id):
        raise CheckpointFailed(f"bad job id {job_id!r}")
    return f"job{job_id.replace('+', '_')}-{image_key(identity)}"


def job_prefix(job_id: str) -> str:
    """Every image (and unfinished dump) name of the job starts with this."""
    return f"job{job_id.replace('+', '_')}-"


def _dirs_named(images_root: Path, prefix: str) -> list[Path]:
    """The directories in ``images_root`` whose names start with ``prefix``, sorted."""
    if not images_root.is_dir():
        return []
    return sorted(p for p in images_root.iterdir() if p.name.startswith(prefix) and p.is_dir())


def job_of_key(name: str) -> str | None:
    """The job an image's (or its folder's) name holds: ``job<id>-...`` (a het job's '+'
    shows as '_'; :func:`image_job_ids` puts it back where a status has the real id).

    >>> job_of_key("job77-ab-cd-ef"), job_of_key("job7_1-ab"), job_of_key(".tmp-job7-ab")
    ('77', '7_1', None)
    """
    head = name.split("-", 1)[0]
    return head[3:] if head.startswith("job") and len(head) > 3 and "-" in name else None


def images_of_job(images_root: Path, job_id: str) -> list[Path]:
    """The finished images of ``job_id`` (temp dirs of unfinished dumps excluded)."""
    return _dirs_named(images_root, job_prefix(job_id))


def temp_dirs(images_root: Path, job_id: str | None = None) -> list[Path]:
    """Directories of unfinished dumps (``.tmp-<key>-<random>``), all or of one job."""
    return _dirs_named(images_root, ".tmp-" + (job_prefix(job_id) if job_id is not None else ""))


def removing_dirs(images_root: Path) -> list[Path]:
    """Images being deleted (:func:`criu.remove_image_soon`; left by a daemon that died)."""
    return _dirs_named(images_root, criu.GONE_PREFIX)


def incomplete_images(images_root: Path) -> list[Path]:
    """Image directories without meta.json: the dumper died between CRIU's end and the
    meta (never restorable: :func:`verify_before_restore` refuses them)."""
    if not images_root.is_dir():
        return []
    return sorted(p for p in images_root.iterdir()
                  if p.is_dir() and p.name.startswith("job") and read_meta(p) is None)  # fmt: skip


def delete_job_images(images_root: Path, job_id: str, *, tree_gone: bool = False) -> list[str]:
    """Delete every image and unfinished dump of ``job_id``; the names deleted.
    ``tree_gone``: as :func:`criu.remove_image`'s (the job will not come back)."""
    gone = []
    for p in images_of_job(images_root, job_id) + temp_dirs(images_root, job_id):
        gone.append(criu.remove_image(p, tree_gone=tree_gone))
    return gone


def _wait_preflight(pid: int, wait_s: float) -> None:
    """The instance closes its socket to us right after asking; give it a moment."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            proctree.preflight(pid)
            return
        except CheckpointFailed:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


def dump_instance(
    images_root: Path, *, job_id: str, pid: int, identity: Identity,
    criu_path: Path | None = None, gpu_uuids: list[str] | None = None,
    pid_start: int | None = None,
    before_criu: Callable[[list[int]], list[tuple[Path, str]] | None] | None = None,
    criu_as_user: bool = True, freeze_tag: str = "",
    before_cuda: Callable[[list[int]], bool] | None = None,
    make_room: Callable[[list[int]], None] | None = None,
) -> DumpReport:  # fmt: skip
    """CUDA-checkpoint (when the tree uses CUDA) and CRIU-dump the tree of ``pid``.

    On success the process is gone (unless kept, below) and the image is complete with
    its meta. On failure the process runs on (CUDA state restored and unlocked again) and
    no image is left. ``gpu_uuids``: the job's GPUs, recorded so a restore on other GPUs
    can remap. ``pid_start``: the start time the caller had when it asked: a pid reused
    meanwhile is not dumped. Every process of the tree must run as ``identity.uid``.

    ``before_criu`` gets the tree's pids once it passed every check and its GPU memory is
    saved, right before CRIU runs (spswapd parks it outside its job there); it must not
    raise. When it returns a list (of file writes: a cgroup freeze) the dump leaves the
    tree running (``--leave-running``), CRIU makes those writes before it lets the tree
    go, the tree stays CUDA-checkpointed for :func:`wake_kept`, and the report says
    ``kept``. A failure after such a CRIU run deletes the image and raises with
    ``tree_kept`` set: the tree is alive, frozen and without its GPU state, and the
    caller ends it.

    ``before_cuda`` gets the tree's pids once it passed every check, before the CUDA
    checkpoint; True when it took the tree out of its job already (spswapd parks it
    first where the parked cgroup keeps the job's device rules: the CUDA checkpoint then
    runs after the job could end). It must not raise.

    ``make_room`` gets the tree's pids after its CUDA checkpoint (its GPU state then in
    host memory, so its size says what the image will take), before ``before_criu``; it
    raises :class:`CheckpointFailed` where there is no room for the image (the tree then
    gets its GPU state back and runs on, as after a failed CRIU run).

    ``criu_as_user``: a tree of a user other than root is dumped by CRIU started as that
    user (``--unprivileged``, see :class:`criu.RunAs`); a kept tree's post-dump freeze is
    then made by root, asked by CRIU's script (:func:`criu_user.root_post_dump`). False:
    root's CRIU (the site setting SPSWAP_CRIU_AS_ROOT=1).

    The credentials are checked on the running tree first, then again on the tree
    frozen right before CRIU (:mod:`freeze_hold`; ``freeze_tag`` names its cgroup, for
    spswapd's sweep), and the image's own after the dump (:mod:`image_creds`): an image
    with another uid, gid, group or a capability is never kept.
    """
    if pid_start is not None and not pid_alive(pid, pid_start):
        raise CheckpointFailed(f"process {pid} is gone or is another process now: not dumped")
    key = job_image_key(job_id, identity)
    delete_job_images(images_root, job_id)  # a job keeps only its newest image
    timings: dict[str, float] = {}
    _wait_preflight(pid, PREFLIGHT_WAIT_S)
    tree = proctree.process_tree_pids(pid)
    problem = credentials_problem(tree, identity.uid)
    if problem:
        raise CheckpointFailed(
            f"not dumped: {problem}; a checkpoint restores credentials, so "
            "only processes of the job's own user are dumped"
        )
    cuda = cuda_ckpt.cuda_pids(tree) if cuda_ckpt.available() else []
    if before_cuda is not None:
        t0 = time.monotonic()
        if before_cuda(tree):
            timings["park"] = time.monotonic() - t0
    if cuda:
        t0 = time.monotonic()
        per_process: dict[str, float] = {}
        cuda = cuda_ckpt.checkpoint_tree(pid, spent_s=per_process)
        timings["cuda_checkpoint"] = time.monotonic() - t0
        timings.update({f"cuda_{k}": v for k, v in per_process.items()})
    try:
        if make_room is not None:
            t0 = time.monotonic()
            make_room(tree)
            timings["make_room"] = time.monotonic() - t0
        t0 = time.monotonic()
        writes = before_criu(tree) if before_criu is not None else None
        timings["before_criu"] = time.monotonic() - t0
        run_as = criu.RunAs.for_uid(identity.uid) if criu_as_user and identity.uid != 0 else None
        keep = writes is not None
        info = dump_frozen(
            pid,
            key,
            images_root,
            identity.uid,
            criu_path=criu_path,
            keep=keep,
            writes=writes,
            run_as=run_as,
            freeze_tag=freeze_tag,
            timings=timings,
        )
    except CheckpointFailed as e:
        if cuda and not getattr(e, "tree_kept", False):  # CRIU resumed the tree: give it
            try:  # its GPU state back
                cuda_ckpt.restore_tree(pid, pids=cuda)
            finally:  # those restored run again even where one process failed
                cuda_ckpt.unlock_tree(pid, pids=cuda)
        raise
    timings["criu_dump"] = info.dump_s
    try:
        atomic_write_json(
            info.path / CUDA_RECORD, {"cuda_pids": cuda, "gpu_uuids": gpu_uuids or []}, mode=0o600
        )
        t0 = time.monotonic()

        write_meta(info.path, identity)
        timings["meta"] = time.monotonic() - t0
    except Exception as e:
        criu.remove_image(info.path)
        failed = CheckpointFailed(f"the image's records could not be written ({e}); the "
                                  "image was deleted")  # fmt: skip
        failed.tree_kept = keep  # type: ignore[attr-defined]
        raise failed from None
    return DumpReport(key, info.path, info.size_bytes, cuda, timings, kept=keep)


def restore_instance(
    images_root: Path, *, job_id: str, expected: Identity, criu_path: Path | None = None,
    gpu_uuids: list[str] | None = None, check_integrity: bool = True,
    read_content: bool = True, criu_as_user: bool = True, hugepages: bool = False,
    cgroup_dirs: list[Path] | None = None, outside: Callable[[str], None] | None = None,
) -> tuple[int, dict[str, float]]:  # fmt: skip
    """Restore the job's image if it matches ``expected``; returns (pid, timings).

    ``cgroup_dirs``: the run's cgroups, where CRIU starts, so that the tree never runs
    under other device rules or limits; where CRIU cannot start there it restores in
    spswapd's own (the caller moves the tree), said through ``outside``.

    ``gpu_uuids``: the GPUs of the run that restores; when they differ from the ones the
    image was dumped on, the CUDA restore remaps (driver >= 580).

    A mismatching or damaged image raises :class:`ImageRejected` with the reason and is
    deleted (it can never become restorable again); the caller cold-starts instead.
    ``read_content``: hash every byte of the image (else its files' names and sizes only;
    see :func:`~spswap.checkpoint.images.verify_before_restore`).
    ``criu_as_user``: an image that a user's CRIU dumped is restored by CRIU as that user.
    ``hugepages``: CRIU fills large private memory in huge pages (SPSWAP_RESTORE_HUGEPAGES).
    """
    images = images_of_job(images_root, job_id)
    if not images:
        raise ImageRejected(f"no image of job {job_id}: cold start")
    image = images[-1]
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    reason = verify_before_restore(image, expected, check_integrity=check_integrity,
                                   read_content=read_content)  # fmt: skip
    if reason is None:  # what the restore would give back, read from the image itself
        problem = image_problem(image, expected.uid, user_groups(expected.uid))
        reason = (
            f"its processes' credentials are not the job user's: {problem}" if problem else None
        )
    timings["verify"] = time.monotonic() - t0
    if reason is not None:
        criu.remove_image(image, tree_gone=True)
        raise ImageRejected(f"image {image.name} not restored: {reason}")
    # A process image is single use: once a restore began, the process may have run on
    # from it, so it is deleted whether the restore succeeded or not (a failed restore
    # is not retried: the caller cold-starts).
    pid: int | None = None
    restored = False
    try:
        record = read_json(image / CUDA_RECORD) or {}
        cuda = list(record.get("cuda_pids", []))
        gpu_map = gpu_map_for(record, gpu_uuids)  # before CRIU: refuses a different count
        t0 = time.monotonic()
        # --auto-dedup frees the image's pages as they are restored (faster, less tmpfs at
        # the peak); fine here: an image is single use and deleted below in any case
        run_as = (criu.RunAs.for_uid(expected.uid)
                  if criu_as_user and expected.uid != 0 else None)  # fmt: skip
        restore = functools.partial(criu.restore, image.name, images_root,
                                    criu=criu_path, auto_dedup=True, run_as=run_as,
                                    hugepages=hugepages)  # fmt: skip
        try:
            pid = restore(cgroup_dirs=cgroup_dirs)
        except CriuNotStarted as e:  # (CRIU never ran: the image is as it was)
            if not cgroup_dirs:
                raise
            if outside is not None:
                outside(str(e))
            pid = restore()
        timings["criu_restore"] = time.monotonic() - t0
        timings.update(cuda_back(pid, cuda, gpu_map))
        restored = True
    except BaseException as e:
        if pid is not None:  # half restored (GPU state missing): it must not run on
            _kill_quietly(pid)
        raise CheckpointFailed(f"{e}\nthe image {image.name} was deleted: cold start") from None
    finally:
        if restored:
            criu.remove_image_soon(image)
        else:  # its tree will not run again: its semaphores' names go too
            criu.remove_image(image, tree_gone=True)
    return pid, timings


def kept_image(images_root: Path, *, job_id: str, expected: Identity) -> Path:
    """The image of the job's kept tree, once its identity matches ``expected`` (the
    bytes are not read: the live tree, not the image, comes back). A mismatch raises
    :class:`ImageRejected` and deletes the image; the caller ends the tree."""
    images = images_of_job(images_root, job_id)
    if not images:
        raise ImageRejected(f"no image of job {job_id}: cold start")
    image = images[-1]
    reason = verify_before_restore(image, expected, check_integrity=False)
    if reason is not None:
        criu.remove_image(image, tree_gone=True)  # (the caller ends the tree)
        raise ImageRejected(f"image {image.name} not restored: {reason}")
    return image


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def image_digests(images_root: Path) -> dict[str, str]:
    """Image key -> the pool digest it needs at restore (its weights' mapping)."""
    out: dict[str, str] = {}
    if not images_root.is_dir():
        return out
    for p in images_root.iterdir():
        meta = read_meta(p) if p.is_dir() and not p.name.startswith(".") else None
        if meta and "identity" in meta:
            out[p.name] = str(meta["identity"].get("model_digest", ""))
    return out


def real_job_ids(statuses_dir: Path | None) -> dict[str, str]:
    """Each job with a checkpoint status, by its images' name prefix (:func:`job_prefix`:
    a het job's '+' shows as '_' there), from the status files, which hold the real id."""
    real: dict[str, str] = {}
    for path in sorted(statuses_dir.glob("*.json")) if statuses_dir and statuses_dir.is_dir() \
            else []:  # fmt: skip
        job = str((read_json(path) or {}).get("job_id") or "")
        if job:
            real[job_prefix(job)] = job
    return real


def real_job_id(real: dict[str, str], job_id: str) -> str:
    """``job_id`` as named in an image's key (a het job's '+' as '_') made the real id,
    through :func:`real_job_ids`' map; as given where the map does not know it."""
    return real.get(job_prefix(job_id), job_id)


def image_job_ids(images_root: Path, statuses_dir: Path | None = None) -> list[str]:
    """The jobs that have finished images. Keys hold the job id with '+' (het jobs) made
    '_': the checkpoint status files, which hold the real id, put it back."""
    real = real_job_ids(statuses_dir)
    ids = set()
    if images_root.is_dir():
        for p in images_root.iterdir():
            if p.is_dir() and (key_job := job_of_key(p.name)) is not None:
                ids.add(real_job_id(real, key_job))
    return sorted(ids)
