"""The slot table's files: ``slots/state.json`` and the lock ``slots/slots.lock``.

The state is one versioned JSON file, replaced atomically, and every change happens
under one file lock that is never unlinked (unlinking a locked file splits waiters
across inodes). Reading and writing only: the rules are in :mod:`spswap.slots.state`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import filelock

from spswap.errors import PermissionDenied, SlotTimeout, SpswapError
from spswap.fsutil import STATE_VERSION, atomic_write_json, close_mode, read_json
from spswap.slots.state import SlotState

STATE_FILE = "state.json"
LOCK_FILE = "slots.lock"
READ_LOCK_TIMEOUT_S = 30.0
# Only the daemon (root) writes here: a lock users could open (flock needs only a
# read-only descriptor) would let any of them hold it forever, and a writable state file
# would let them grant themselves GPUs. Users read the state without the lock.
DIR_MODE = 0o755
STATE_MODE = 0o644
LOCK_MODE = 0o600


def _make_lock(path: Path) -> filelock.BaseFileLock:
    # preserve_lock_file (filelock >= 4) rules out the soft-lock fallback, which
    # releases by unlinking its marker; older versions never unlink on Unix.
    try:
        return filelock.FileLock(path, mode=LOCK_MODE, preserve_lock_file=True)  # type: ignore[call-arg,unused-ignore]
    except TypeError:
        return filelock.FileLock(path, mode=LOCK_MODE)


class SlotStore:
    """The state file and lock in ``slots_dir``; ``clean`` runs on every state read
    (the table reclaims what dead holders left)."""

    def __init__(self, slots_dir: Path, clean: Callable[[SlotState], None]) -> None:
        self.slots_dir = Path(slots_dir)
        self.state_path = self.slots_dir / STATE_FILE
        self.lock_path = self.slots_dir / LOCK_FILE
        self._clean = clean
        if not self.slots_dir.is_dir():
            try:
                self.slots_dir.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
                os.chmod(self.slots_dir, DIR_MODE)  # whatever the umask
            except PermissionError:
                pass  # a user looking before the daemon made it: reads see an empty table
        self._tighten_modes()
        self._lock = _make_lock(self.lock_path)

    def _tighten_modes(self) -> None:
        # Earlier releases made these world-writable; whoever owns them (root in
        # production) takes write access away from everyone else on sight.
        for path, mode in ((self.slots_dir, DIR_MODE), (self.state_path, STATE_MODE),
                           (self.lock_path, LOCK_MODE)):  # fmt: skip
            try:
                close_mode(path, mode)
            except OSError:
                pass

    @property
    def read_only(self) -> bool:
        """True when this process cannot take the lock (a user: changes go through spswapd)."""
        target = self.lock_path if self.lock_path.exists() else self.slots_dir
        return not os.access(target, os.W_OK)

    def check_writable(self, what: str) -> None:
        """Raise :class:`PermissionDenied` (at once, not after a lock timeout) when read-only."""
        if self.read_only:
            raise PermissionDenied(
                f"cannot {what}: the slot table ({self.slots_dir}) is root's (you are uid "
                f"{os.getuid()}); as a user, `spswap slots reserve` / `release` and `spswap "
                "serve` change it through spswapd (started by the Slurm prolog, or by root "
                "with `spswap daemon start`)"
            )

    @contextmanager
    def locked(self, deadline: float | None = None) -> Iterator[SlotState]:
        """Hold the lock, load and clean the state; save it if it changed (not when the
        block raises). ``deadline`` (monotonic) bounds the wait for the lock."""
        if deadline is None:
            timeout_s = READ_LOCK_TIMEOUT_S
        else:
            timeout_s = max(deadline - time.monotonic(), 0.0)
        try:
            # A held lock is only ever held for one read-modify-write; waiting for the
            # queue happens outside it, so a short poll is enough.
            self._lock.acquire(timeout=max(timeout_s, 1.0), poll_interval=0.001)
        except filelock.Timeout:
            raise SlotTimeout(
                f"could not take the slot lock {self.lock_path} in {max(timeout_s, 1.0):.1f} s; "
                f"a process holds it without letting go (find it with `fuser {self.lock_path}`)",
                holders=[],
            ) from None
        try:
            st = self.load()
            self._clean(st)
            yield st
            if st.dirty:
                atomic_write_json(self.state_path, st.to_json(), mode=STATE_MODE)
        finally:
            self._lock.release()

    @contextmanager
    def view(self) -> Iterator[SlotState]:
        """The state for reading: locked (and cleaned) when this process may write it,
        else read without the lock (the file is replaced atomically) and cleaned in memory."""
        if not self.read_only:
            with self.locked() as st:
                yield st
            return
        st = self.load()
        self._clean(st)
        yield st

    def load(self) -> SlotState:
        """The state on disk (empty when there is no file yet), without the lock."""
        data = read_json(self.state_path)
        if data is None:
            return SlotState()
        if data.get("version") != STATE_VERSION:
            raise SpswapError(
                f"{self.state_path} has version {data.get('version')!r}, this spswap reads "
                f"version {STATE_VERSION}; upgrade spswap or move the file aside"
            )
        return SlotState.from_json(data)
