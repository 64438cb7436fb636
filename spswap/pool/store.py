"""The node-wide weight pool: entries on tmpfs, capacity, LRU eviction and live users.

The files are laid out as :mod:`spswap.pool.layout` says. Entry directories appear
(rename from a temp dir) and disappear (rename to a temp dir, then delete) only under
the index lock, so eviction, removal, publication and acquiring a use never race.
What to evict is :mod:`spswap.pool.capacity`'s choice. No torch here.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from spswap.config import Config
from spswap.errors import PoolCorrupt, PoolEntryInUse, PoolEntryNotFound, PoolError
from spswap.fsutil import dir_size_bytes, fs_sizes, read_json
from spswap.liveness import Holder, JobProbe
from spswap.pool import importer, layout
from spswap.pool.capacity import EntryInfo, UserShare, plan_eviction, users_of
from spswap.pool.index import (
    IndexState,
    PoolIndex,
    Reservation,
    check_uses_left,
    file_key,
    source_key,
)
from spswap.pool.layout import DATA_FILE, DIR_MODE, LOCKS_DIR, MANIFEST_FILE, make_locks_dir
from spswap.pool.manifest import Manifest, SourceFile
from spswap.pool.names import MIN_PREFIX_CHARS, looks_like_digest
from spswap.pool.verify import verify_entry
from spswap.pool.writer import EntryWriter

DEFAULT_CAPACITY_FRACTION = 0.8


class Pool:
    """The weight pool in one directory. Safe to use from many processes at once."""

    def __init__(
        self, pool_dir: Path, *, capacity_bytes: int | None = None,
        job_alive: JobProbe | None = None, user_bytes: int | None = None,
        importer_uid: int | None = None,
    ) -> None:  # fmt: skip
        """``importer_uid``: the user whose share of the pool (``user_bytes``, default
        half the capacity) this object's imports count in; None or root: no share (root's
        own imports, and a pool written directly)."""
        self.pool_dir = Path(pool_dir)
        self._capacity_bytes = capacity_bytes
        self._user_bytes = user_bytes
        self.importer_uid = importer_uid if importer_uid != 0 else None
        self.job_alive = job_alive
        self.index = PoolIndex(self.pool_dir, job_alive)
        # what this object's imports evicted, and for what: "share" (the importing user's)
        # or "capacity" (the pool's, or its file system's), for spswapd's events
        self.evictions: list[tuple[EntryInfo, str]] = []

    @classmethod
    def from_config(cls, cfg: Config, job_alive: JobProbe | None = None,
                    importer_uid: int | None = None) -> Pool:  # fmt: skip
        """The pool under ``cfg.paths.pool`` with ``cfg.pool_capacity_bytes`` and
        ``cfg.pool_user_bytes``."""
        return cls(cfg.paths.pool, capacity_bytes=cfg.pool_capacity_bytes, job_alive=job_alive,
                   user_bytes=cfg.pool_user_bytes, importer_uid=importer_uid)  # fmt: skip

    @property
    def read_only(self) -> bool:
        """True for a caller that may read the pool but not change it (a user, not root):
        ls, find, data_path and verify work; uses and imports go through spswapd."""
        return self.index.read_only

    # -- sizes -------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        """The configured limit, else 80% of the size of the file system holding the pool."""
        if self._capacity_bytes is not None:
            return self._capacity_bytes
        return int(fs_sizes(self.pool_dir)[0] * DEFAULT_CAPACITY_FRACTION)

    @property
    def user_bytes(self) -> int:
        """What one user's imports may hold: the configured share, else half the capacity."""
        return self._user_bytes if self._user_bytes is not None else self.capacity_bytes // 2

    @property
    def used_bytes(self) -> int:
        """Bytes on disk of every published entry."""
        return sum(dir_size_bytes(d) for d in self._entry_dirs())

    def _fs_free_bytes(self) -> int:
        return fs_sizes(self.pool_dir)[1]

    # -- looking up ----------------------------------------------------------------------

    def entry_dir(self, digest: str) -> Path:
        return self.pool_dir / digest

    def data_path(self, manifest: Manifest) -> Path:
        return self.entry_dir(manifest.digest) / DATA_FILE

    def _entry_dirs(self) -> list[Path]:
        try:
            return sorted(p for p in self.pool_dir.iterdir()
                          if p.is_dir() and layout.is_entry_dir_name(p.name))  # fmt: skip
        except FileNotFoundError:
            return []

    def _manifests(self) -> list[Manifest]:
        out = []
        for d in self._entry_dirs():
            raw = read_json(d / MANIFEST_FILE)
            if raw is None:
                continue
            try:
                out.append(Manifest.from_json(raw))
            except (PoolCorrupt, KeyError, TypeError, ValueError):
                continue
        return out

    def _live_digests(self) -> set[str]:
        return {d.name for d in self._entry_dirs()}

    def entries(self) -> list[EntryInfo]:
        """Every entry, most recently used first."""
        state = self.index.read_unlocked()
        out = []
        for m in self._manifests():
            rec = state.entries.get(m.digest)
            out.append(EntryInfo(
                manifest=m, path=self.entry_dir(m.digest),
                size_bytes=dir_size_bytes(self.entry_dir(m.digest)),
                last_used=rec.last_used if rec and rec.last_used else m.created,
                users=list(rec.uses) if rec else [],
                importers=list(rec.importers) if rec else [],
            ))  # fmt: skip
        return sorted(out, key=lambda e: -e.last_used)

    def find(self, ref: str) -> Manifest:
        """The entry a reference names: one that looks like a digest (6 to 64 hex digits)
        by its digest or a unique prefix of it, anything else by its name. Never a name for
        a digest: names are chosen by whoever imports (see :mod:`spswap.pool.names`)."""
        manifests = self._manifests()
        if looks_like_digest(ref):
            hits = [m for m in manifests if m.digest.startswith(ref.lower())]
            if len(hits) == 1:
                return hits[0]
            if len(hits) > 1:
                raise PoolError(
                    f"digest prefix {ref!r} matches {len(hits)} entries; give more of it"
                )
        else:
            by_name = [m for m in manifests if m.name == ref]
            if len(by_name) == 1:
                return by_name[0]
            if len(by_name) > 1:
                digests = ", ".join(m.digest[:12] for m in by_name)
                raise PoolError(f"{len(by_name)} pool entries are named {ref!r} ({digests}); "
                                "name one by its digest")  # fmt: skip
        have = ", ".join(f"{m.name} ({m.digest[:12]})" for m in manifests) or "none"
        raise PoolEntryNotFound(
            f"no pool entry named {ref!r} or with a digest starting with it (at least "
            f"{MIN_PREFIX_CHARS} characters; references that look like digests are matched "
            f"against digests only); entries in {self.pool_dir}: {have}. "
            "Import one with: spswap pool import PATH"
        )

    # -- users ---------------------------------------------------------------------------

    def acquire_use(self, ref: str, holder: Holder | None = None) -> Manifest:
        """Mark the entry as used by ``holder`` (default: this process): never evicted while
        the holder lives. Pair with :meth:`release_use` (or use :meth:`use`)."""
        holder = holder or Holder.current()
        with self.index.locked(self._live_digests) as state:
            m = self.find(ref)
            check_uses_left(state, holder)
            rec = state.record(m.digest)
            rec.uses.append(holder)
            rec.last_used = time.time()
        return m

    def release_use(self, digest: str, holder: Holder) -> None:
        """Drop one use of ``digest`` by ``holder`` (no error when it is already gone)."""
        key = _holder_key(holder)
        with self.index.locked(self._live_digests) as state:
            rec = state.entries.get(digest)
            if rec is None:
                return
            for i, h in enumerate(rec.uses):
                if _holder_key(h) == key:
                    del rec.uses[i]
                    break
            rec.last_used = time.time()

    @contextmanager
    def use(self, ref: str, holder: Holder | None = None) -> Iterator[Manifest]:
        """Hold a use of the entry for the ``with`` block; touches its last use."""
        holder = holder or Holder.current()
        m = self.acquire_use(ref, holder)
        try:
            yield m
        finally:
            self.release_use(m.digest, holder)

    # -- capacity ------------------------------------------------------------------------

    def ensure_room(self, size_bytes: int) -> list[str]:
        """Evict least-recently-used entries without live users until ``size_bytes`` fit.

        Returns the evicted digests. Raises :class:`PoolFull` (and evicts nothing) when
        even evicting every unused entry would not be enough.
        """
        with self.index.locked(self._live_digests) as state:
            return self._make_room(state, size_bytes, exclude=None)

    def reserve_room(self, name: str, size_bytes: int, holder: Holder) -> list[str]:
        """Make room and hold it for the temp build dir ``name`` until it is published."""
        with self.index.locked(self._live_digests) as state:
            evicted = self._make_room(state, size_bytes, exclude=name)
            state.reservations[name] = Reservation(size_bytes, holder, self.importer_uid)
        return evicted

    def release_reservation(self, name: str) -> None:
        if not self.index.path.exists():
            return
        with self.index.locked() as state:
            state.reservations.pop(name, None)

    def _make_room(self, state: IndexState, size_bytes: int, *, exclude: str | None) -> list[str]:
        capacity = self.capacity_bytes
        infos = self.entries()
        uid = self.importer_uid
        share = None if uid is None else UserShare(uid, self.user_bytes)
        plan = plan_eviction(infos, state, size_bytes, capacity_bytes=capacity,
                             fs_free_bytes=self._fs_free_bytes(), exclude=exclude,
                             user=share)  # fmt: skip
        for digest in plan.release:  # off this user's share, onto its users' (if any)
            rec = state.record(digest)
            rec.importers.remove(uid)  # type: ignore[arg-type]
            rec.importers.extend(u for u in users_of(state, digest) if u not in rec.importers)
        for e in plan.evict:
            self._delete_entry(state, e.manifest.digest)
            why = "share" if e.manifest.digest in plan.for_share else "capacity"
            self.evictions.append((e, why))
        return [e.manifest.digest for e in plan.evict]

    # -- publishing and removing ---------------------------------------------------------

    def publish(self, tmp: Path, manifest: Manifest, reservation: str) -> tuple[Manifest, bool]:
        """Rename a finished temp dir into place; keep an existing entry with the same digest.

        Returns ``(manifest, reused)``.
        """
        final = self.entry_dir(manifest.digest)
        with self.index.locked(self._live_digests) as state:
            reserved = state.reservations.get(reservation)
            if (final / MANIFEST_FILE).is_file():
                state.reservations.pop(reservation, None)
                shutil.rmtree(tmp, ignore_errors=True)
                state.touch(manifest.digest)
                self._charge(state, manifest.digest)
                return Manifest.from_json(read_json(final / MANIFEST_FILE)), True
            # a build may come out larger than it reserved (its manifest's tensor names):
            # the bounds hold for what is published; the reservation still counts here
            size = dir_size_bytes(tmp)
            if reserved is None or size > reserved.size_bytes:
                self._make_room(state, size - (reserved.size_bytes if reserved else 0),
                                exclude=None)  # fmt: skip
            state.reservations.pop(reservation, None)
            if final.exists():  # an empty or broken leftover with our digest
                self._trash(final)
            os.rename(tmp, final)
            state.touch(manifest.digest)
            state.record(manifest.digest).sealed = file_key(final / DATA_FILE)
            self._charge(state, manifest.digest)
            if manifest.sources:
                state.sources[source_key(manifest.sources)] = (manifest.digest, manifest.sources)
        return manifest, False

    def _charge(self, state: IndexState, digest: str) -> None:
        importers = state.record(digest).importers
        if self.importer_uid is not None and self.importer_uid not in importers:
            importers.append(self.importer_uid)

    def remove(self, ref: str, *, force: bool = False) -> Manifest:
        """Delete an entry; refuses (:class:`PoolEntryInUse`) while a live user holds it."""
        with self.index.locked(self._live_digests) as state:
            m = self.find(ref)
            rec = state.entries.get(m.digest)
            if rec and rec.uses and not force:
                who = "; ".join(h.describe() for h in rec.uses)
                raise PoolEntryInUse(
                    f"pool entry {m.name} ({m.digest[:12]}) is in use by {who}; stop those "
                    "jobs first, or pass --force (those jobs run on with the entry's pages "
                    "as they are now but cannot be checkpointed: their next runs start anew, "
                    "reading the model's files)"
                )
            self._delete_entry(state, m.digest)
        return m

    def _delete_entry(self, state: IndexState, digest: str) -> None:
        self._trash(self.entry_dir(digest))
        state.forget(digest)

    def _trash(self, path: Path) -> None:
        # Rename first so the entry vanishes atomically; a crash mid-delete leaves a temp
        # dir that the next import cleans up.
        trash = self.pool_dir / layout.tmp_dir_name(Holder.current())
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def remove_stale_tmp_dirs(self) -> list[str]:
        """Delete temp dirs whose builder process is gone; returns their names."""
        return layout.remove_stale_tmp_dirs(self.pool_dir)

    # -- writing -------------------------------------------------------------------------

    def writer(
        self, name: str, *, identity: dict[str, Any] | None = None,
        sources: Sequence[SourceFile] = (), expected_size_bytes: int | None = None,
    ) -> EntryWriter:  # fmt: skip
        """A context manager that builds one entry (see :class:`EntryWriter`).

        ``expected_size_bytes`` (the padded data size: :func:`padded_size_bytes` of the
        tensor sizes) reserves room, evicting if needed,
        before anything is written; without it room is made when the entry is published.
        """
        self.index.check_writable(f"write pool entry {name!r}")
        self.ensure_dirs()
        return EntryWriter(self, name, identity=identity, sources=sources,
                           expected_size_bytes=expected_size_bytes)  # fmt: skip

    def ensure_dirs(self) -> None:
        self.pool_dir.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        make_locks_dir(self.pool_dir / LOCKS_DIR)

    def import_checkpoint(
        self, path: Path, *, name: str | None = None,
        progress: Callable[[int, int], None] | None = None,
        identity: dict[str, Any] | None = None,
    ) -> Manifest:  # fmt: skip
        """Import a safetensors checkpoint (file or directory); see :mod:`spswap.pool.importer`."""
        self.index.check_writable(f"import {path}")
        return importer.import_checkpoint(self, Path(path), name=name, progress=progress,
                                          identity=identity)  # fmt: skip

    def find_by_sources(self, sources: Sequence[SourceFile]) -> Manifest | None:
        """The entry imported from exactly these files (path, size, mtime), touched; or None."""
        sources = tuple(sources)
        with self.index.locked(self._live_digests) as state:
            hit = state.sources.get(source_key(sources))
            if hit is None or hit[1] != sources:
                return None
            raw = read_json(self.entry_dir(hit[0]) / MANIFEST_FILE)
            if raw is None:
                return None
            state.touch(hit[0])
            return Manifest.from_json(raw)

    def remember_sources(self, sources: Sequence[SourceFile], digest: str) -> None:
        """Record that these source files hold the content of ``digest``."""
        sources = tuple(sources)
        with self.index.locked(self._live_digests) as state:
            if digest in self._live_digests():
                state.sources[source_key(sources)] = (digest, sources)

    def remember_alias(self, key: str, digest: str) -> None:
        """Record that ``key`` (see :func:`alias_key`) names entry ``digest``."""
        self.index.check_writable(f"record an alias of {digest[:12]}")
        with self.index.locked(self._live_digests) as state:
            if digest in self._live_digests():
                state.aliases[key] = digest

    def find_alias(self, key: str) -> Manifest | None:
        """The entry ``key`` names, or None (never recorded, or the entry is gone)."""
        digest = self.index.read_unlocked().aliases.get(key)
        if digest is None:
            return None
        raw = read_json(self.entry_dir(digest) / MANIFEST_FILE)
        return Manifest.from_json(raw) if raw is not None else None

    # -- checking ------------------------------------------------------------------------

    def verify(self, ref: str) -> Manifest:
        """Recompute every checksum; :class:`PoolCorrupt` names the first bad tensor, users."""
        m = self.find(ref)
        verify_entry(m, self.data_path(m), index=self.index)
        return m


def _holder_key(h: Holder) -> tuple[int, int | None, int, str | None, str | None]:
    return (h.pid, h.pid_start, h.uid, h.job_id, h.for_job)
