"""The pool's bookkeeping: last use, live users, source aliases and space reservations.

One JSON file, ``<pool>/index.json``, read and written only under the lock
``<pool>/.locks/index.lock``. Every read under the lock drops what is dead: users and
reservations whose holder is gone, and records of entries whose directory vanished,
so a crashed process never pins an entry or a reservation for good. Pure
bookkeeping: no torch, no Slurm (the job probe is plugged in).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock

from spswap.errors import PermissionDenied, RequestRefused
from spswap.fsutil import atomic_write_json, read_json
from spswap.liveness import Holder, JobProbe, holder_alive
from spswap.pool.layout import (
    INDEX_FILE,
    INDEX_LOCK_FILE,
    INDEX_MODE,
    LOCK_MODE,
    LOCKS_DIR,
    make_locks_dir,
)
from spswap.pool.manifest import SourceFile

INDEX_VERSION = 1
# what one user may hold of the pool's use records at once (a job holds one per model
# per run): bounds the index that every pool op reads
MAX_USES_PER_USER = 1024


FileKey = tuple[int, int, int, int]  # a data file's device, inode, size, mtime (ns)


def file_key(path: os.PathLike[str] | str) -> FileKey | None:
    """What changes when a data file is written or replaced (None: it is not there).
    (A write through a shared mapping leaves a tmpfs file's time alone: spswap's own
    mappings of entries are read-only.)"""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _key_from_json(raw: Any) -> FileKey | None:
    if not isinstance(raw, list) or len(raw) != 4:
        return None  # an index from before seals: the entry is read once, then sealed
    return (int(raw[0]), int(raw[1]), int(raw[2]), int(raw[3]))


def source_key(sources: Sequence[SourceFile]) -> str:
    """Key of a set of source files by path only: same files, same import lock and the
    same record in :attr:`IndexState.sources`."""
    return hashlib.sha256("\0".join(sorted(s.path for s in sources)).encode()).hexdigest()[:32]


@dataclass
class EntryRecord:
    last_used: float = 0.0
    uses: list[Holder] = field(default_factory=list)
    # users whose share of the pool it counts in: they imported it through spswapd
    # (root's and direct imports count in no share)
    importers: list[int] = field(default_factory=list)
    # the data file as it was published or last read whole (its file_key): a
    # process that asks to serve from the entry has it read again only once it changed
    sealed: FileKey | None = None


@dataclass
class Reservation:
    size_bytes: int
    holder: Holder
    uid: int | None = None  # the user whose share the build counts in, if any


@dataclass
class IndexState:
    """The decoded index; mutate it inside :meth:`PoolIndex.locked`."""

    entries: dict[str, EntryRecord] = field(default_factory=dict)
    # source key -> (digest, the exact source files it was imported from)
    sources: dict[str, tuple[str, tuple[SourceFile, ...]]] = field(default_factory=dict)
    # temp build dir name -> room reserved for it
    reservations: dict[str, Reservation] = field(default_factory=dict)
    # alias key (an engine layout identity + the uid that exported it) -> digest: one entry
    # serves every user who exported the same bytes (see Pool.remember_alias)
    aliases: dict[str, str] = field(default_factory=dict)

    def record(self, digest: str) -> EntryRecord:
        return self.entries.setdefault(digest, EntryRecord())

    def touch(self, digest: str, now: float | None = None) -> None:
        self.record(digest).last_used = time.time() if now is None else now

    def reserved_bytes(self, *, exclude: str | None = None) -> int:
        return sum(r.size_bytes for k, r in self.reservations.items() if k != exclude)

    def forget(self, digest: str) -> None:
        self.entries.pop(digest, None)
        for key in [k for k, (d, _) in self.sources.items() if d == digest]:
            del self.sources[key]
        for key in [k for k, d in self.aliases.items() if d == digest]:
            del self.aliases[key]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": INDEX_VERSION,
            "entries": {d: {"last_used": r.last_used, "uses": [h.to_json() for h in r.uses],
                            "importers": sorted(r.importers),
                            "sealed": list(r.sealed) if r.sealed else None}
                        for d, r in sorted(self.entries.items())},
            "sources": {k: {"digest": d, "sources": [s.to_json() for s in srcs]}
                        for k, (d, srcs) in sorted(self.sources.items())},
            "reservations": {k: {"size_bytes": r.size_bytes, "holder": r.holder.to_json(),
                                 "uid": r.uid}
                             for k, r in sorted(self.reservations.items())},
            "aliases": dict(sorted(self.aliases.items())),
        }  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> IndexState:
        if not d:
            return cls()
        return cls(
            entries={k: EntryRecord(float(v.get("last_used", 0.0)),
                                    [Holder.from_json(h) for h in v.get("uses", [])],
                                    [int(u) for u in v.get("importers", [])],
                                    _key_from_json(v.get("sealed")))
                     for k, v in d.get("entries", {}).items()},
            sources={k: (str(v["digest"]), tuple(SourceFile.from_json(s) for s in v["sources"]))
                     for k, v in d.get("sources", {}).items()},
            reservations={k: Reservation(int(v["size_bytes"]), Holder.from_json(v["holder"]),
                                         None if v.get("uid") is None else int(v["uid"]))
                          for k, v in d.get("reservations", {}).items()},
            aliases={str(k): str(v) for k, v in d.get("aliases", {}).items()},
        )  # fmt: skip


def check_uses_left(state: IndexState, holder: Holder) -> None:
    """RequestRefused when a user already holds :data:`MAX_USES_PER_USER` uses."""
    if holder.uid == 0:
        return
    held = sum(1 for rec in state.entries.values() for h in rec.uses if h.uid == holder.uid)
    if held >= MAX_USES_PER_USER:
        raise RequestRefused(
            f"you (uid {holder.uid}) hold {held} uses of pool entries on this node, the "
            "most one user may hold (each process or job that runs a model holds one); end "
            "the processes that hold them ('spswap pool ls' lists each entry's users)"
        )


class PoolIndex:
    """``index.json`` of one pool directory, with its lock."""

    def __init__(self, pool_dir: Path, job_alive: JobProbe | None = None) -> None:
        self.pool_dir = pool_dir
        self.path = pool_dir / INDEX_FILE
        self.locks_dir = pool_dir / LOCKS_DIR
        self.job_alive = job_alive
        self._lock: FileLock | None = None

    def lock_path(self, name: str) -> Path:
        return self.locks_dir / name

    def _file_lock(self) -> FileLock:
        if self._lock is None:
            make_locks_dir(self.locks_dir)
            self._lock = FileLock(str(self.locks_dir / INDEX_LOCK_FILE), mode=LOCK_MODE)
        return self._lock

    @property
    def read_only(self) -> bool:
        """True when this process cannot take the index lock: it may read, not write."""
        for target in (self.locks_dir / INDEX_LOCK_FILE, self.locks_dir, self.pool_dir):
            try:
                if target.exists():
                    return not os.access(target, os.W_OK)
            except PermissionError:  # the lock directory is its owner's alone
                return True
        return False  # nothing yet: whoever creates the pool may write it

    def check_writable(self, what: str = "change the pool") -> None:
        """Raise :class:`PermissionDenied` (at once, not after a lock timeout) when read-only."""
        if self.read_only:
            raise PermissionDenied(
                f"cannot {what}: the pool ({self.pool_dir}) is root's (you are uid "
                f"{os.getuid()}); as a user, `spswap pool import` and `spswap serve` write it "
                "through spswapd (started by the Slurm prolog, or by root with `spswap daemon "
                "start`); removing an entry is root's alone"
            )

    def sealed(self, digest: str) -> FileKey | None:
        """Entry ``digest``'s seal (None: none recorded); no lock, and no user's liveness
        probed (a probe may ask Slurm: this is on every run's start)."""
        entry = ((read_json(self.path) or {}).get("entries") or {}).get(digest) or {}
        return _key_from_json(entry.get("sealed"))

    def seal(self, digest: str, key: FileKey | None) -> None:
        """Record entry ``digest``'s data file as read whole (``key``: as it was then)."""
        with self.locked() as state:
            if digest in state.entries:
                state.entries[digest].sealed = key

    def alive(self, holder: Holder) -> bool:
        return holder_alive(holder, self.job_alive)

    def read_unlocked(self) -> IndexState:
        """A snapshot for display (no lock, nothing pruned but dead users filtered)."""
        state = IndexState.from_json(read_json(self.path))
        for rec in state.entries.values():
            rec.uses = [h for h in rec.uses if self.alive(h)]
        return state

    @contextmanager
    def locked(self, live_digests: Callable[[], set[str]] | None = None
               ) -> Iterator[IndexState]:  # fmt: skip
        """Hold the index lock; yield the pruned state; write it back if it changed.

        ``live_digests``: lists the entries that exist on disk; records of others are
        dropped. It is called once the lock is held: a list taken before could miss an
        entry published while this caller waited, and forget its uses.
        The lock is re-entrant within one :class:`PoolIndex`, and nested blocks see and
        change the same state.
        """
        self.check_writable()
        lock = self._file_lock()
        with lock:
            outer = getattr(self, "_state", None)
            if outer is not None:
                yield outer
                return
            raw = read_json(self.path)
            state = IndexState.from_json(raw)
            self._prune(state, live_digests() if live_digests is not None else None)
            self._state: IndexState | None = state
            try:
                yield state
                new = state.to_json()
                if new != (raw or IndexState().to_json()):
                    atomic_write_json(self.path, new, mode=INDEX_MODE)
            finally:
                self._state = None

    def _prune(self, state: IndexState, live_digests: set[str] | None) -> None:
        for rec in state.entries.values():
            rec.uses = [h for h in rec.uses if self.alive(h)]
        for key in [k for k, r in state.reservations.items() if not self.alive(r.holder)]:
            del state.reservations[key]
        if live_digests is not None:
            for digest in [d for d in state.entries if d not in live_digests]:
                state.forget(digest)
            for key in [k for k, (d, _) in state.sources.items() if d not in live_digests]:
                del state.sources[key]
            for key in [k for k, d in state.aliases.items() if d not in live_digests]:
                del state.aliases[key]


def alias_key(identity: dict[str, Any], uid: int) -> str:
    """Key of an engine layout ``identity`` as exported by ``uid`` (``owner_uid`` in the
    identity is ignored: the uid given here is the one that counts)."""
    ident = {k: v for k, v in identity.items() if k != "owner_uid"}
    text = json.dumps({"identity": ident, "uid": uid}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
