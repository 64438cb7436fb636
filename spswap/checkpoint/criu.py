"""Run CRIU: find it, check it, dump a process tree into an image, restore it.

Images live in ``<images_root>/<key>/``. A dump writes into a hidden temporary directory
next to it and renames it only when CRIU succeeded, so a half-written image is never
visible under its key; on any failure (tmpfs full included) the partial image is deleted
and :class:`~spswap.errors.CheckpointFailed` carries the last lines of CRIU's log.

CRIU's log goes to a pipe (``--log-file -``), not to a file next to the image: when the
image's file system fills up, a log file there would lose exactly the lines that say so.
The captured log is written afterwards into the image (``dump.log``) or, on failure, into
the log directory (default ``<images_root>/.logs/``).

Restores are detached (``--restore-detached``): the restored tree is re-parented to init
(or the nearest subreaper), not left as a child of the caller; its pid comes from a
pidfile. The alternative, restoring as our child through ``criu swrk`` with
``rst_sibling``, needs pycriu, which only ships in CRIU's source tree.

Dumps and restores need root (the daemon runs them). Given a :class:`RunAs`, root starts
CRIU as the job's user in ``--unprivileged`` mode (``criu_argv.as_user_argv``): the image
directory is then the user's for the run, but sits in root's 0700 images root, so CRIU
reaches it only through a descriptor root opened (``/proc/self/fd/N``) and no other
process of the user can; after a dump root takes the files back before the image gets its
name.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spswap.checkpoint import criu_argv, link_remap, proctree
from spswap.checkpoint.criu_find import (  # noqa: F401 - callers use them from here
    BUILD_HINT,
    MIN_VERSION,
    SETTING_FIX,
    _require_criu,
    available,
    criu_check,
    criu_setting,
    criu_version,
    find_criu,
    missing_text,
)
from spswap.checkpoint.criu_log import first_error, hint_for, log_tail, write_log
from spswap.checkpoint.criu_run import DEFAULT_GRACE_S, DyingWatch, run_criu
from spswap.checkpoint.criu_user import RunAs, as_user_dir, root_post_dump, root_prefix
from spswap.checkpoint.image_creds import image_problem
from spswap.checkpoint.proctree import wait_pids_free
from spswap.errors import CheckpointFailed
from spswap.fsutil import atomic_write_json, dir_size_bytes, read_json

DUMP_META = "spswap-dump.json"
GONE_PREFIX = ".gone-"  # an image being deleted (see remove_image_soon)
# CRIU's link_remap.<id> names are per directory, its ids per dump: dumps and restores
# of trees with such files run one at a time on the node (see link_remap and
# _links_lock): a lock for this process's threads, and a file lock in root's /run for
# every process (other spswapd roots on one host, as tests run them).
_LINKS = threading.Lock()
LINKS_LOCK_FILE = Path("/run/spswap-link-remap.lock")


@contextlib.contextmanager
def _links_lock() -> Iterator[None]:
    import fcntl

    with _LINKS:
        try:  # root's /run only: a file lock others could take would let them stall dumps
            fd = os.open(LINKS_LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError:
            fd = None  # not root (tests of the module): the thread lock is all there is
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            if fd is not None:
                os.close(fd)


@dataclass(frozen=True)
class ImageInfo:
    """A complete CRIU image on disk."""

    key: str
    path: Path
    pid: int
    size_bytes: int
    dump_s: float
    criu_version: tuple[int, int, int]


def _check_key(key: str) -> None:
    if not key or "/" in key or key.startswith(".") or key != key.strip():
        raise CheckpointFailed(
            f"bad image key {key!r}: use letters, digits, '-', '_' (no '/', no leading '.')"
        )


POST_DUMP_SCRIPT = "spswap-post-dump.sh"
RESTORE_PIDFILE = "spswap-restore.pid"


def dump(
    pid: int,
    image_key: str,
    images_root: Path,
    *,
    criu: Path | None = None,
    leave_running: bool = False,
    tcp_close: bool = False,
    ghost_limit_bytes: int | None = None,
    log_dir: Path | None = None,
    timeout_s: float = 600.0,
    post_dump_writes: list[tuple[Path, str]] | None = None,
    run_as: RunAs | None = None,
    freeze_cgroup: tuple[str, list[int]] | None = None,
    owner: tuple[int, set[int] | None] | None = None,
    killed_grace_s: float = DEFAULT_GRACE_S,
) -> ImageInfo:
    """Dump the tree rooted at ``pid`` into ``images_root/<image_key>/``.

    Unless ``leave_running``, the tree is gone after a successful dump. On failure the
    partial image is deleted, the tree keeps running (CRIU resumes it) and
    CheckpointFailed carries the log's path and last lines. ``post_dump_writes`` (with
    ``leave_running``): files written once the image is complete, before CRIU lets the
    tree go (a cgroup freeze; see :func:`criu_argv.post_dump_script`). ``run_as``: CRIU
    runs as that user (``--unprivileged``); root then makes the post-dump writes, asked
    by the script (:func:`criu_user.root_post_dump`). ``freeze_cgroup``: the frozen
    cgroup the tree waits in and the descriptors CRIU needs to reach it
    (:meth:`freeze_hold.FreezeHold.for_criu`). ``owner`` (uid, the user's groups or
    None): the image's recorded credentials must all be that user's
    (:func:`image_creds.image_problem`), else it is deleted before it gets its name and
    CheckpointFailed says why (with ``tree_kept`` when the tree was left running).
    CRIU is ended once ``pid`` has been dying for ``killed_grace_s`` (see
    :mod:`criu_run`).
    """
    path, version = _require_criu(criu)
    _check_key(image_key)
    final = images_root / image_key
    if final.exists():
        raise CheckpointFailed(f"image {final} exists already: remove it first or use a new key")
    pids, self_tcp = proctree.preflight(pid)
    linked = link_remap.deleted_but_linked(pids)
    # A connection of the tree to itself cannot be kept across a restore without network
    # locking; it is restored closed (torch.distributed's store in a one-GPU vLLM: unused
    # once the engine is up).
    tcp_close = tcp_close or self_tcp
    log_dir = log_dir or images_root / ".logs"
    images_root.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = images_root / f".tmp-{image_key}-{secrets.token_hex(4)}"
    tmp.mkdir(mode=0o700)
    shell_job = os.getsid(pid) != pid
    try:
        atomic_write_json(tmp / DUMP_META, {
            "version": 1, "pid": pid, "shell_job": shell_job,
            "pids": pids, "tids": sorted({t for p in pids for t in proctree.thread_ids(p)}),
            "criu_version": list(version), "dumped_at": time.time(), "tcp_close": tcp_close,
            **({"run_as": {"uid": run_as.uid, "gid": run_as.gid, "groups": list(run_as.groups)}}
               if run_as is not None else {}),
        })  # fmt: skip
        writes = [(str(f), v) for f, v in post_dump_writes or []]
        # CRIU as the user cannot make the freeze: root does, asked by the script
        hook = (
            root_post_dump(images_root.parent, run_as, writes)
            if run_as is not None and leave_running and writes
            else contextlib.nullcontext()
        )
        start = time.monotonic()
        aside: list[tuple[str, str]] = []
        with (
            hook as root_hook,
            _links_lock() if linked else contextlib.nullcontext(),
            as_user_dir(tmp, run_as) as (images_arg, fds),
        ):
            script = None
            if leave_running and (linked or writes):  # see post_dump_script
                script = (root_hook.script_dir if root_hook else tmp) / POST_DUMP_SCRIPT
                script.write_text(criu_argv.post_dump_script(
                    writes, sorted({f.directory for f in linked}),
                    link_remap.parked_name(image_key, link_remap.CRIU_PREFIX),
                    root_fifos=(str(root_hook.request), str(root_hook.answer)) if root_hook
                    else None))  # fmt: skip
                script.chmod(0o755 if root_hook else 0o700)
            argv = (run_as.prefix() if run_as else root_prefix()) + criu_argv.dump_argv(
                str(path), pid=pid, images_dir=Path(images_arg), log_file="-",
                leave_running=leave_running, shell_job=shell_job, tcp_close=tcp_close,
                ghost_limit_bytes=ghost_limit_bytes, link_remap=bool(linked),
                action_script=script, unprivileged=run_as is not None,
                freeze_cgroup=freeze_cgroup[0] if freeze_cgroup else None,
            )  # fmt: skip
            try:
                link_remap.set_aside([f.directory for f in linked], aside)
                passed = fds + (freeze_cgroup[1] if freeze_cgroup else [])
                rc, log = run_criu(argv, timeout_s, passed, give_up=DyingWatch(pid, killed_grace_s))
                records = link_remap.park(linked, image_key) if linked and rc == 0 else []
            finally:
                left_aside = link_remap.put_back(aside)
        dump_s = time.monotonic() - start
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if rc != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        if script is not None and linked:  # links the script made before CRIU failed
            link_remap.discard(link_remap.park(linked, image_key))
        log_path = write_log(log, log_dir / f"{image_key}.dump.log")
        raise CheckpointFailed(
            f"criu dump of pid {pid} into {final} failed (exit {rc}): {_what(log)}; "
            "the partial image was deleted",
            log_path=str(log_path) if log_path else None, log_tail=log_tail(log),
        )  # fmt: skip
    problem = image_problem(tmp, *owner) if owner is not None else None
    if problem is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        link_remap.discard(records)
        failed = CheckpointFailed(
            f"the image of pid {pid} was deleted, never kept: {problem}; a restore gives "
            "back the credentials a dump recorded, so only images whose every process has "
            "the job user's uid, gid and groups and no capabilities are kept (a setuid or "
            "setgid program, or one with file capabilities, ran in the tree)")  # fmt: skip
        failed.tree_kept = leave_running  # type: ignore[attr-defined]
        raise failed
    extra: dict[str, Any] = {}
    if records:  # CRIU's links, renamed to this image's own names (see link_remap)
        extra["link_remaps"] = records
    if aside:  # somebody else's link_remap.* names, moved out of CRIU's way for the run
        extra["names_set_aside"] = [original for _, original in aside]
    if left_aside:
        extra["names_left_aside"] = left_aside
    if extra:
        meta = read_json(tmp / DUMP_META) or {}
        meta.update(extra)
        atomic_write_json(tmp / DUMP_META, meta)
    # The image is complete; a log that does not fit any more must not cost the image.
    if write_log(log, tmp / "dump.log") is None:
        write_log(log, log_dir / f"{image_key}.dump.log")
    try:
        os.rename(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointFailed(f"could not move the finished image to {final}: {e}") from None
    return ImageInfo(image_key, final, pid, dir_size_bytes(final), dump_s, version)


def restore(
    image_key: str,
    images_root: Path,
    *,
    criu: Path | None = None,
    pid_wait_s: float = 5.0,
    tcp_close: bool = False,
    auto_dedup: bool = False,
    log_dir: Path | None = None,
    timeout_s: float = 600.0,
    run_as: RunAs | None = None,
    cgroup_dirs: list[Path] | None = None,
    hugepages: bool = False,
) -> int:
    """Restore ``images_root/<image_key>/`` detached; returns the restored root pid.

    ``hugepages``: CRIU fills large private memory in huge pages (SPSWAP_RESTORE_HUGEPAGES;
    a CRIU without spswap's thp-fill patch ignores it).

    ``auto_dedup`` frees the image while restoring (faster, single use: delete it after).
    ``cgroup_dirs``: CRIU, and so the restored tree, starts in these cgroups (one per
    hierarchy; else in spswapd's own).
    ``run_as``: CRIU runs as that user (``--unprivileged``), so the kernel checks every
    path it reopens with the user's rights; the image must have been dumped that way.
    """
    path, _ = _require_criu(criu)
    _check_key(image_key)
    image_dir = images_root / image_key
    if not image_dir.is_dir():
        raise CheckpointFailed(f"no image {image_dir}: dump one first")
    meta = read_json(image_dir / DUMP_META) or {}
    if "pid" not in meta:
        raise CheckpointFailed(f"{image_dir} has no {DUMP_META}: not an image spswap dumped")
    wait_pids_free(sorted({int(meta["pid"]), *meta.get("pids", []), *meta.get("tids", [])}),
                   pid_wait_s)  # fmt: skip
    if run_as is not None and meta.get("run_as", {}).get("uid") != run_as.uid:
        raise CheckpointFailed(f"{image_dir} was not dumped by CRIU as uid {run_as.uid}: "
                               "not restored that way")  # fmt: skip
    log_dir = log_dir or images_root / ".logs"
    with (
        tempfile.TemporaryDirectory(prefix="spswap-restore-") as scratch,
        as_user_dir(image_dir, run_as) as (images_arg, fds),
    ):
        # a user's CRIU writes its pidfile into the image directory (relative to it)
        pidfile = Path(RESTORE_PIDFILE) if run_as else Path(scratch) / "pid"
        argv = (run_as.prefix() if run_as else root_prefix()) + criu_argv.restore_argv(
            str(path), images_dir=Path(images_arg), log_file="-", pidfile=pidfile,
            shell_job=bool(meta.get("shell_job")),
            tcp_close=tcp_close or bool(meta.get("tcp_close")), auto_dedup=auto_dedup,
            unprivileged=run_as is not None,
        )  # fmt: skip
        if run_as:
            pidfile = image_dir / RESTORE_PIDFILE
        remaps = list(meta.get("link_remaps", []))
        aside: list[tuple[str, str]] = []
        own = frozenset((int(r["dev"]), int(r["ino"])) for r in remaps if "dev" in r)
        left_aside: list[str] = []
        with _links_lock() if remaps else contextlib.nullcontext():
            try:
                link_remap.set_aside([str(r["dir"]) for r in remaps], aside, keep=own)
                try:
                    link_remap.unpark(remaps)
                    rc, log = run_criu(argv, timeout_s, fds, cgroup_dirs, env=criu_argv.restore_env(
                        os.environ, hugepages=hugepages))  # fmt: skip
                except BaseException:
                    link_remap.drop_unparked(remaps)
                    raise
                if rc != 0:
                    link_remap.drop_unparked(remaps)
            finally:
                left_aside = link_remap.put_back(aside)
        if left_aside:  # their names were taken meanwhile: say where they are
            log += f"\nspswap: names left aside (their names were taken meanwhile): {left_aside}\n"
        log_path = write_log(log, log_dir / f"{image_key}.restore.log")
        if rc != 0:
            raise CheckpointFailed(
                f"criu restore of {image_dir} failed (exit {rc}): {_what(log)}",
                log_path=str(log_path) if log_path else None, log_tail=log_tail(log),
            )  # fmt: skip
        try:
            return int(pidfile.read_text().strip())
        except (OSError, ValueError):
            return int(meta["pid"])


def _what(log: str) -> str:
    """CRIU's first error, then what to do about it (the tail follows in the error)."""
    first = first_error(log)
    return f"{first}; {hint_for(log)}" if first else hint_for(log)


def remove_image(image_dir: Path, *, tree_gone: bool = False) -> str:
    """Delete an image (or an unfinished dump) with what it keeps outside its directory
    (its parked links, see link_remap); returns its name. ``tree_gone``: its tree will
    never run again (its job ended, the image was refused, its kept tree was ended), so
    the names of the semaphores it held go too (see link_remap.drop_semaphore_names)."""
    meta = read_json(image_dir / DUMP_META) or {}
    if tree_gone:
        link_remap.drop_semaphore_names(list(meta.get("link_remaps", [])))
    link_remap.discard(list(meta.get("link_remaps", [])))
    shutil.rmtree(image_dir, ignore_errors=True)
    return image_dir.name


def remove_image_soon(image_dir: Path) -> str:
    """:func:`remove_image` with its slow part off the caller's path: the image stops
    being one at once (its directory takes a ``.gone-`` name, which nothing but
    spswapd's start-up sweep looks at; its outside links go) and a thread frees its
    pages (a few GB of tmpfs: 0.3-0.4 s, which a restore's reply waited for)."""
    gone = image_dir.with_name(f"{GONE_PREFIX}{image_dir.name}-{secrets.token_hex(4)}")
    try:
        image_dir.rename(gone)  # first: no longer an image, whatever happens next
    except OSError:  # (gone already, or a read-only root): the slow way
        return remove_image(image_dir)
    meta = read_json(gone / DUMP_META) or {}
    # now, not later: the job's next image (same key) takes the same link names
    link_remap.discard(list(meta.get("link_remaps", [])))
    (gone / DUMP_META).unlink(missing_ok=True)  # so no sweep discards those names again
    free_soon(gone)
    return image_dir.name


def free_soon(path: Path) -> None:
    """Delete the directory ``path`` in a thread (at once where no thread can start)."""
    try:
        threading.Thread(target=shutil.rmtree, args=(path,), kwargs={"ignore_errors": True},
                         name="image-removal", daemon=True).start()  # fmt: skip
    except RuntimeError:  # no thread to be had (a thread limit): the caller waits instead
        shutil.rmtree(path, ignore_errors=True)
