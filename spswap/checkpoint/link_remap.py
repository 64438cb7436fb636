"""Files a tree holds under a deleted name while another name still links them, and the
hard links CRIU makes for them.

glibc's ``sem_open`` maps a temporary ``/dev/shm/sem.XXXXXX``, links it to
``/dev/shm/sem.NAME`` and unlinks the temporary name: every multiprocessing lock of a
spawn-started Python (vLLM's server) is such a file. CRIU dumps one only with
``--link-remap``: it hard-links the inode as ``<dir>/link_remap.<id>``, and the restore
opens that name and removes it. The ids are per dump and can repeat between images (a
second parked image would then need the first one's name: CRIU fails the dump on EEXIST),
and an image never restored would leave its link behind.

So right after a dump spswap renames each link to a name of its own image
(``.spswap-remap-<image key>-<id>``, same directory, so a rename always works), puts it
back just before the restore, and removes it with the image.

The ``link_remap.*`` names of a directory are everybody's: in ``/dev/shm`` any user can
make one, and CRIU fails a dump or restore whose name is taken. spswap's own CRIU runs
with such files take turns (``criu._links_lock``), so whatever holds one of those names during
a run is somebody else's: it is set aside for the run (:func:`set_aside`) and put back
after it (:func:`put_back`).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spswap.errors import CheckpointFailed
from spswap.fsutil import rename_noreplace

DELETED = " (deleted)"
CRIU_PREFIX = "link_remap."
PARKED_PREFIX = ".spswap-remap-"
ASIDE_PREFIX = ".spswap-aside-"
SEMAPHORE_PREFIX = "sem."  # glibc's names of named POSIX semaphores in /dev/shm
PROC = Path("/proc")


@dataclass(frozen=True)
class LinkedFile:
    """A regular file the tree reaches by a deleted name while it still has a link."""

    directory: str
    dev: int
    ino: int


def deleted_but_linked(pids: list[int], proc: Path = PROC) -> list[LinkedFile]:
    """Every such file among the mappings and open files of ``pids`` (``map_files`` needs
    root; unreadable entries are skipped: CRIU itself needs root)."""
    found: dict[tuple[int, int], LinkedFile] = {}
    for pid in pids:
        for sub in ("map_files", "fd"):
            base = proc / str(pid) / sub
            try:
                names = os.listdir(base)
            except OSError:
                continue
            for name in names:
                try:
                    target = os.readlink(base / name)
                    if not (target.startswith("/") and target.endswith(DELETED)):
                        continue
                    st = os.stat(base / name)  # the open file itself, through the magic link
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_nlink > 0:
                    directory = os.path.dirname(target[: -len(DELETED)])
                    found.setdefault((st.st_dev, st.st_ino),
                                     LinkedFile(directory, st.st_dev, st.st_ino))  # fmt: skip
    return list(found.values())


def in_root_dirs(files: list[LinkedFile]) -> bool:
    """Whether every directory of ``files``, and each directory above it, is root's and
    no symlink: where a root-run step (the post-dump script of a kept dump) may link by
    path without a user swapping a path component under it (``/dev/shm`` is)."""
    return all(_root_chain(f.directory) for f in files)


def _root_chain(directory: str) -> bool:
    """Root's all the way up, no symlink, and none that others may rename entries of
    (writable by group or others without the sticky bit)."""
    path = Path(directory)
    for d in [path, *path.parents]:
        try:
            st = os.lstat(d)
        except OSError:
            return False
        if st.st_uid != 0 or not stat.S_ISDIR(st.st_mode):
            return False
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return False
    return True


def names_taken(directories: list[str]) -> list[str]:
    """CRIU's names (``link_remap.*``) present in ``directories``: left by a CRIU that
    died, or made by someone; CRIU fails on the one it needs (EEXIST)."""
    taken = []
    for directory in sorted(set(directories)):
        try:
            taken += [os.path.join(directory, n) for n in sorted(os.listdir(directory))
                      if n.startswith(CRIU_PREFIX)]  # fmt: skip
        except OSError:
            continue
    return taken


def set_aside(directories: list[str], moved: list[tuple[str, str]],
              keep: frozenset[tuple[int, int]] = frozenset()) -> None:  # fmt: skip
    """Before a CRIU run with link remaps in ``directories`` (under ``criu._links_lock``, so
    no run of spswap's is making such names meanwhile): move every ``link_remap.*`` there
    out of CRIU's way, to ``.spswap-aside-<random>-<name>`` in the same directory (a
    rename: the file itself, whoever's it is, stays as it was), appending (aside path,
    original path) to ``moved`` as it goes, for :func:`put_back`. Files in ``keep``
    (device, inode: the image's own links) stay. A name that cannot be moved is left (CRIU
    then fails on it only if it needs that very name). Only in directories that are
    root's all the way up (``/dev/shm``, see :func:`_root_chain`), where no user can swap
    a path component under the renames; in a user's own directory only that user can make
    such names."""
    import secrets

    token = secrets.token_hex(12)
    for path in names_taken([d for d in directories if _root_chain(d)]):
        directory, name = os.path.split(path)
        aside = os.path.join(directory, f"{ASIDE_PREFIX}{token}-{name}")
        try:
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) in keep:
                continue
            rename_noreplace(path, aside)
        except OSError:
            continue
        moved.append((aside, path))


def put_back(moved: list[tuple[str, str]]) -> list[str]:
    """After the CRIU run: each name :func:`set_aside` moved back where it was, never over
    a file that took the name meanwhile (that one is kept; the moved one stays aside and
    its path is returned)."""
    left = []
    for aside, original in moved:
        try:
            rename_noreplace(aside, original)
        except OSError:
            left.append(aside)
    return left


def parked_name(image_key: str, criu_name: str) -> str:
    """``link_remap.7`` of image ``k`` -> ``.spswap-remap-k-7``."""
    return f"{PARKED_PREFIX}{image_key}-{criu_name.removeprefix(CRIU_PREFIX)}"


def park(files: list[LinkedFile], image_key: str) -> list[dict[str, Any]]:
    """After a successful dump: rename CRIU's links of ``files`` to this image's names.
    Returns the records the image keeps (directory, CRIU's name, the parked name). Never
    raises: the tree is gone by now, and a link left under CRIU's name still restores.

    After a dump that left the tree running CRIU has deleted its links already, and the
    dump's action script has linked them under this image's names
    (:func:`spswap.checkpoint.criu_argv.post_dump_script`): those are taken as parked
    when they are the tree's files, and removed otherwise (a planted ``link_remap.*``)."""
    wanted = {(f.dev, f.ino) for f in files}
    mine = parked_name(image_key, CRIU_PREFIX)
    records: list[dict[str, Any]] = []
    for directory in sorted({f.directory for f in files}):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in sorted(names):
            path = os.path.join(directory, name)
            try:
                st = os.lstat(path)
                ours = (st.st_dev, st.st_ino) in wanted and stat.S_ISREG(st.st_mode)
                if name.startswith(mine):  # linked by the action script
                    if not ours:
                        os.unlink(path)
                        continue
                    criu_name, parked = CRIU_PREFIX + name[len(mine) :], name
                elif name.startswith(CRIU_PREFIX) and ours:
                    criu_name, parked = name, parked_name(image_key, name)
                    try:
                        os.rename(path, os.path.join(directory, parked))
                    except OSError:
                        parked = None  # left under CRIU's name: restored from there
                else:
                    continue  # another image's, or not ours
            except OSError:
                continue
            records.append({"dir": directory, "name": criu_name, "parked": parked,
                            "dev": st.st_dev, "ino": st.st_ino})  # fmt: skip
    return records


def unpark(records: list[dict[str, Any]]) -> None:
    """Before a restore: CRIU's names back (as new links; the parked ones stay until the
    image goes). The directory may be the user's: a link is made only of the very file
    parked (device and inode, never through a symlink) and checked after it is made.
    Refuses, naming the file, when a name is taken or the file is not the one parked."""
    for r in records:
        target, want = os.path.join(r["dir"], r["name"]), (r.get("dev"), r.get("ino"))
        if r.get("parked") is None:  # left under CRIU's name by the dump: still the file?
            try:
                st = os.lstat(target)
            except OSError:
                st = None
            if st is None or not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != want:
                raise CheckpointFailed(
                    f"cannot restore: {target} is not the file the dump "
                    "left there (gone or replaced): the image is unusable"
                )
            continue
        parked = os.path.join(r["dir"], r["parked"])
        try:
            st = os.lstat(parked)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != want:
                raise CheckpointFailed(
                    f"cannot restore: {parked} is not the file the dump "
                    "set aside (replaced since): the image is unusable"
                )
            os.link(parked, target, follow_symlinks=False)
            st = os.lstat(target)
        except FileExistsError:
            raise CheckpointFailed(
                f"cannot restore: {target} exists (owner uid {_owner(target)}): CRIU needs "
                "that name; left by a CRIU that died, or put there by someone; root may "
                "remove it"
            ) from None
        except OSError as e:
            raise CheckpointFailed(f"cannot restore: linking {target} failed: {e}") from None
        if (st.st_dev, st.st_ino) != want:  # swapped between the check and the link
            os.unlink(target)
            raise CheckpointFailed(f"cannot restore: {parked} changed while it was linked back")


def _owner(path: str) -> str:
    try:
        return str(os.lstat(path).st_uid)
    except OSError:
        return "?"


def drop_unparked(records: list[dict[str, Any]]) -> None:
    """After a failed restore: remove CRIU's names that are still this image's links (one
    the dump left under CRIU's name stays: it is the image's only link)."""
    for r in records:
        if r.get("parked") is None:
            continue
        target = os.path.join(r["dir"], r["name"])
        try:
            st = os.lstat(target)
            if (st.st_dev, st.st_ino) == (r.get("dev"), r.get("ino")):
                os.unlink(target)
        except OSError:
            continue


def discard(records: list[dict[str, Any]]) -> None:
    """With the image: remove its parked links (only names of spswap's own form, or
    CRIU's name when the dump left the link there and it is still the file)."""
    for r in records:
        if r.get("parked") is None:
            drop_unparked([{**r, "parked": r["name"]}])
            continue
        name = str(r.get("parked", ""))
        if not name.startswith(PARKED_PREFIX) or "/" in name:
            continue
        try:
            os.unlink(os.path.join(str(r["dir"]), name))
        except OSError:
            continue


def drop_semaphore_names(records: list[dict[str, Any]]) -> list[str]:
    """With the image of a tree that will never run again: the other names of its
    re-linked files that are named POSIX semaphores (``sem.*`` of the same inode in the
    same directory). Their creator's resource tracker unlinks them when the tree exits;
    a dump ends the tree, tracker and all, so an image never restored would leave them
    for good. Only in root's directories (no path component swapped under the unlink),
    and only while the image's own link holds the inode open here (a number matched
    after its inode was freed could be somebody else's file); the paths removed."""
    removed = []
    for r in records:
        directory = str(r.get("dir", ""))
        own = str(r.get("parked") or r.get("name") or "")
        if not own or "/" in own or not _root_chain(directory):
            continue
        try:  # held open while the names are matched: its number cannot be reused
            held = os.open(os.path.join(directory, own), os.O_PATH | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            st = os.fstat(held)
            if (st.st_dev, st.st_ino) == (r.get("dev"), r.get("ino")):
                removed += _unlink_names_of(directory, st)
        finally:
            os.close(held)
    return removed


def _unlink_names_of(directory: str, held: os.stat_result) -> list[str]:
    """Unlink the ``sem.*`` names in ``directory`` of the inode ``held``."""
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith(SEMAPHORE_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino):
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue
    return removed
