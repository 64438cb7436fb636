"""Small file helpers shared by the pool, the slot table and the image cache.

State files are versioned JSON, written to a temporary file in the same directory,
fsync'ed and renamed over the old one, so a reader sees the old or the new state and
never half of one.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from spswap.errors import PermissionDenied, SpswapError

STATE_VERSION = 1


def close_mode(path: Path, mode: int) -> None:
    """Take away every permission bit of ``path`` beyond ``mode`` when this process owns
    it (what an earlier release left open); raises OSError as os.stat does."""
    st = os.stat(path)
    if st.st_uid == os.geteuid() and st.st_mode & 0o777 & ~mode:
        os.chmod(path, mode)


def atomic_write_bytes(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically (same directory temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_json(path: Path, obj: Any, *, mode: int = 0o644) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode(), mode=mode)


def read_json(path: Path, *, default: Any = None) -> Any:
    """Read a JSON file; ``default`` when it does not exist.

    A file that exists but does not parse is an error that names the file, since the
    state it held can't be trusted any more.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return default
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SpswapError(
            f"{path} is not valid JSON ({e}); move it aside and run the command again"
        ) from None


def existing_parent(path: Path) -> Path:
    """``path``, or its nearest folder that exists (a root not made yet lives on the file
    system of the folder it will be made in)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def fs_sizes(path: Path) -> tuple[int, int]:
    """(size, free for users) in bytes of the file system holding ``path`` (or its nearest
    existing folder); raises OSError where it cannot be read."""
    st = os.statvfs(existing_parent(path))
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def dir_size_bytes(path: Path) -> int:
    """Total size of the regular files below ``path``."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass
    return total


def others_can_replace(path: Path, uid: int) -> str | None:
    """Why another user could swap ``path`` (or a directory above it) for one of their own,
    or None when only ``uid`` and root can: every existing directory on the way must be
    owned by ``uid`` or root and, unless sticky (as /tmp), not writable by group or
    others. Used before a private socket or file is made there."""
    import stat

    p = Path(os.path.abspath(path))
    for d in [p, *p.parents]:
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            continue  # made later, by us
        if stat.S_ISLNK(st.st_mode):  # its owner may point it elsewhere later; where it
            # leads must be as safe
            if st.st_uid not in (0, uid):
                return f"{d} is a symbolic link owned by uid {st.st_uid}"
            why = others_can_replace(d.resolve(), uid)
            if why:
                return why
            continue
        if st.st_uid not in (0, uid):
            return f"{d} belongs to uid {st.st_uid}"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"{d} is writable by {'group' if st.st_mode & 0o020 else 'others'} (mode " \
                   f"{stat.S_IMODE(st.st_mode):o})"  # fmt: skip
    return None


def evict_page_cache(directory: Path) -> bool:
    """Drop the files under ``directory`` from the page cache (fsync + POSIX_FADV_DONTNEED:
    no root needed), so a cold start reads the disk. Best effort: returns whether every
    file was advised."""
    ok = True
    for path in sorted(Path(directory).rglob("*")):
        if not path.is_file():
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError:
            ok = False
    return ok


def make_private_dirs(path: Path, uid: int) -> None:
    """Create what is missing of ``path`` with mode 0700 (whatever the umask), then check
    the whole existing path with :func:`others_can_replace`; PermissionDenied naming the
    fix when someone else could swap a part of it."""
    p = Path(os.path.abspath(path))
    for d in reversed([p, *p.parents]):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue
    why = others_can_replace(p, uid)
    if why:
        raise PermissionDenied(
            f"{path} is not private: {why}; give --state-dir under a directory only you (and "
            "root) can write, e.g. $HOME/.spswap/<job id>"
        )
    os.chmod(p, 0o700)


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


@functools.cache
def _libc() -> Any:
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def rename_noreplace(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` unless ``dst`` exists (``renameat2`` with
    ``RENAME_NOREPLACE``: no window in which someone else's new ``dst`` is replaced).
    Raises FileExistsError when it exists, OSError otherwise (also where the C library,
    the kernel or the file system lacks it: then nothing was renamed)."""
    import ctypes
    import errno

    try:
        renameat2 = _libc().renameat2
    except AttributeError:  # glibc < 2.28
        raise OSError(errno.ENOSYS, "renameat2 is not in this C library", src) from None
    rc = renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), src, None, dst)
