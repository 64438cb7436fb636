"""Where the pool keeps what: file names, directory layout and modes.

Layout under ``pool_dir`` (``$SPSWAP_ROOT/pool``)::

    <digest>/manifest.json, <digest>/data.bin   one entry, immutable once renamed in
    .tmp-<pid>-<start>-<rand>/                  an entry being built (or being removed)
    .locks/index.lock, .locks/import-<key>.lock  file locks (never unlinked)
    index.json                                  last use, users, source aliases, reservations

A leaf of the pool package: every other pool module names files through this one.
No torch.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

from spswap.fsutil import close_mode
from spswap.liveness import Holder, pid_alive

MANIFEST_FILE = "manifest.json"
DATA_FILE = "data.bin"
INDEX_FILE = "index.json"
LOCKS_DIR = ".locks"
INDEX_LOCK_FILE = "index.lock"
TMP_PREFIX = ".tmp-"

# Entries are world-readable (jobs map them) and written only by the pool's owner.
FILE_MODE = 0o644
DIR_MODE = 0o755
# Written only by root (the daemon, or root on the command line): users read the index
# and the entries, and record their uses and imports through spswapd.
INDEX_MODE = 0o644
# The lock files are the writers' alone: flock needs only a read-only descriptor, so a
# user who could open them could hold the pool's lock forever (every dump, import and use
# would wait). Users read the index without it.
LOCK_MODE = 0o600
LOCKS_DIR_MODE = 0o700


def import_lock_name(source_key: str) -> str:
    """The lock file (in :data:`LOCKS_DIR`) that serialises imports of one source set."""
    return f"import-{source_key}.lock"


def make_locks_dir(path: Path) -> None:
    """The pool's lock directory, only its owner's (see :data:`LOCK_MODE`); one an earlier
    release made open to all is closed on sight by its owner."""
    path.mkdir(parents=True, exist_ok=True, mode=LOCKS_DIR_MODE)
    close_mode(path, LOCKS_DIR_MODE)


def is_entry_dir_name(name: str) -> bool:
    """Whether a child of the pool directory named ``name`` may be an entry (not a temp
    dir, the lock directory or another dot-file)."""
    return not name.startswith(".")


def tmp_dir_name(holder: Holder) -> str:
    """``.tmp-<pid>-<pid start>-<random>``: enough to tell later whether its builder died."""
    return f"{TMP_PREFIX}{holder.pid}-{holder.pid_start or 0}-{uuid.uuid4().hex[:12]}"


def tmp_dir_owner_alive(name: str) -> bool:
    """Whether the process that created temp dir ``name`` still runs (unparsable: no)."""
    parts = name[len(TMP_PREFIX) :].split("-")
    try:
        pid, start = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return False
    return pid_alive(pid, start or None)


def remove_stale_tmp_dirs(pool_dir: Path) -> list[str]:
    """Delete the temp dirs in ``pool_dir`` whose builder process is gone; their names."""
    removed: list[str] = []
    try:
        children = list(pool_dir.iterdir())
    except FileNotFoundError:
        return removed
    for p in children:
        if p.name.startswith(TMP_PREFIX) and not tmp_dir_owner_alive(p.name):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return removed
