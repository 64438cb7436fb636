"""Check a pool entry against its manifest: file size, layout, digest and every checksum;
and take a damaged entry out of the pool."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from spswap.errors import PoolCorrupt, PoolEntryNotFound
from spswap.pool.copy import Range, ShortRead, hash_ranges
from spswap.pool.index import PoolIndex, file_key
from spswap.pool.manifest import Manifest, content_digest


def default_fix(manifest: Manifest, *, in_use: bool) -> str:
    """What to do about a damaged entry: root removes it (at once, or once its users
    ended), and the next job that runs the model imports it again from its files."""
    rm = f"spswap pool rm {manifest.digest[:12]}"
    how = (f"as root, end those jobs (scancel) and remove it ({rm}), or remove it now "
           f"({rm} --force: they run on but cannot be checkpointed)" if in_use
           else f"remove it as root ({rm})")  # fmt: skip
    return f"{how}; the next job that runs the model imports it again from its files"


def verify_entry(manifest: Manifest, data_path: Path, *, fix: str | None = None,
                 index: PoolIndex | None = None) -> None:  # fmt: skip
    """Raise :class:`PoolCorrupt` (with ``tensor`` set where one is to blame) on any
    mismatch; its message says, with the pool's ``index``, the entry's live users, whose
    weights come from its pages (looked up only then: each user's liveness is a probe),
    and ends with ``fix`` (default: how root removes it, with those users or without)."""
    label = f"pool entry {manifest.name} ({manifest.digest[:12]})"

    def corrupt(what: str, tensor: str | None = None) -> PoolCorrupt:
        rec = index.read_unlocked().entries.get(manifest.digest) if index else None
        users = tuple(h.describe() for h in rec.uses) if rec else ()
        told = f"{label}: {what}"
        if users:
            told += (f"; it is in use by {'; '.join(users)} (a job on CPU answers from these "
                     "pages now, one on a GPU copies them at its next wake)")  # fmt: skip
        return PoolCorrupt(f"{told}; {fix or default_fix(manifest, in_use=bool(users))}",
                           tensor=tensor, users=users)  # fmt: skip

    if content_digest(manifest.tensors) != manifest.digest:
        raise corrupt("manifest does not match its digest")
    try:
        fd = os.open(data_path, os.O_RDONLY)
    except FileNotFoundError:
        raise corrupt(f"{data_path} is missing") from None
    try:
        size = os.fstat(fd).st_size
        if size != manifest.data_size_bytes:
            raise corrupt(f"{data_path} has {size} bytes, the manifest says "
                          f"{manifest.data_size_bytes}")  # fmt: skip
        ranges = [Range(t.name, fd, t.offset, t.size_bytes) for t in manifest.tensors]
        try:
            got = hash_ranges(ranges)
        except ShortRead:  # pragma: no cover - the size check above catches it first
            raise corrupt(f"{data_path} is shorter than its tensors") from None
    finally:
        os.close(fd)
    for t in sorted(manifest.tensors, key=lambda t: t.offset):
        if got[t.name] != t.checksum:
            raise corrupt(f"tensor {t.name!r} (bytes {t.offset}..{t.offset + t.size_bytes} "
                          f"of {data_path}) does not match its checksum", t.name)  # fmt: skip


class _Entries(Protocol):
    @property
    def index(self) -> PoolIndex: ...
    def find(self, ref: str) -> Manifest: ...
    def data_path(self, manifest: Manifest) -> Path: ...
    def remove(self, ref: str, *, force: bool = False) -> Manifest: ...


REMOVED_FIX = "removed from the pool: the model is read from its files and imported again"


def remove_if_damaged(pool: _Entries, ref: str) -> tuple[Manifest, str | None]:
    """Read entry ``ref`` of ``pool`` (a :class:`~spswap.pool.store.Pool`) against its
    checksums; a damaged one is removed whoever uses it (it serves no one right; mapped
    copies stay valid until their processes exit). Returns the entry and what was wrong
    with it, or None when it is whole."""
    for _ in range(2):  # a second read only where the entry was replaced under the first
        m = pool.find(ref)
        path = pool.data_path(m)
        read = file_key(path)
        try:
            verify_entry(m, path, fix=REMOVED_FIX)
        except PoolCorrupt as e:
            problem = str(e)
        else:
            return m, None
        # the bytes read are the entry's still (not removed and imported again, whole,
        # by another run while this one read for seconds); the rest of the window is
        # the few microseconds to the index lock
        if file_key(path) != read:
            continue
        try:
            pool.remove(m.digest, force=True)
        except PoolEntryNotFound:
            pass  # removed meanwhile (another run found it damaged too)
        return m, problem
    return m, None  # replaced twice while read: whoever replaced it checks it


def check_unless_sealed(pool: _Entries, ref: str) -> tuple[Manifest, str | None]:
    """:func:`remove_if_damaged`, but read only where the entry's data file changed since
    it was published or last read whole (its seal in the index; an entry sealed by no
    spswap before this check is read once): a stat where nothing wrote to it, a whole
    read where something did (a stray ``dd`` or copy onto the file). Found whole, it is
    sealed with the file as it was before the read (a write during the read breaks the
    seal). Callers need the index writable (spswapd, root)."""
    m = pool.find(ref)
    key = file_key(pool.data_path(m))
    if key is not None and pool.index.sealed(m.digest) == key:
        return m, None
    try:
        m, problem = remove_if_damaged(pool, m.digest)
    except PoolEntryNotFound:  # another run read it at the same time and removed it
        return m, (f"pool entry {m.name} ({m.digest[:12]}) was found damaged by another run "
                   f"at the same time; {REMOVED_FIX}")  # fmt: skip
    if problem is None:
        pool.index.seal(m.digest, key)
    return m, problem


def import_checked(pool: _Entries, read: Callable[[], Manifest],
                   on_damaged: Callable[[Manifest, str], None]) -> Manifest:  # fmt: skip
    """``read()``: an import, which hands back the entry an earlier import made of the same
    files where there is one. That entry may have been written over since it was sealed
    (:func:`check_unless_sealed`): damaged, it is removed, ``on_damaged`` is told (the
    entry, what was wrong) and ``read()`` runs again, a fresh import of the files."""
    manifest = read()
    found, problem = check_unless_sealed(pool, manifest.digest)
    if problem is None:
        return manifest
    on_damaged(found, problem)
    return read()
