"""Check a pool entry against its manifest: file size, layout, digest and every checksum;
and take a damaged entry out of the pool."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from spswap.errors import PoolCorrupt, PoolEntryNotFound
from spswap.pool.copy import Range, ShortRead, hash_ranges
from spswap.pool.index import PoolIndex
from spswap.pool.manifest import Manifest, content_digest


def verify_entry(manifest: Manifest, data_path: Path, *, fix: str | None = None,
                 index: PoolIndex | None = None) -> None:  # fmt: skip
    """Raise :class:`PoolCorrupt` (with ``tensor`` set where one is to blame) on any
    mismatch; its message ends with ``fix`` (default: remove the entry, import again)
    and, with the pool's ``index``, the entry's live users, whose weights come from its
    pages (looked up only then: each user's liveness is a probe)."""
    if fix is None:
        fix = f"remove it (spswap pool rm {manifest.digest[:12]}) and import it again"
    label = f"pool entry {manifest.name} ({manifest.digest[:12]})"

    def corrupt(what: str, tensor: str | None = None) -> PoolCorrupt:
        rec = index.read_unlocked().entries.get(manifest.digest) if index else None
        users = "; ".join(h.describe() for h in rec.uses) if rec else ""
        told = fix
        if users:
            told += (f"; it is in use by {users}: a job on CPU answers from these pages now, "
                     "one on a GPU copies them at its next wake")  # fmt: skip
        return PoolCorrupt(f"{label}: {what}; {told}", tensor=tensor)

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
    def find(self, ref: str) -> Manifest: ...
    def data_path(self, manifest: Manifest) -> Path: ...
    def remove(self, ref: str, *, force: bool = False) -> Manifest: ...


REMOVED_FIX = "removed from the pool: the model is read from its files and imported again"


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def remove_if_damaged(pool: _Entries, ref: str) -> tuple[Manifest, str | None]:
    """Read entry ``ref`` of ``pool`` (a :class:`~spswap.pool.store.Pool`) against its
    checksums; a damaged one is removed whoever uses it (it serves no one right; mapped
    copies stay valid until their processes exit). Returns the entry and what was wrong
    with it, or None when it is whole."""
    for _ in range(2):  # a second read only where the entry was replaced under the first
        m = pool.find(ref)
        path = pool.data_path(m)
        read = _file_id(path)
        try:
            verify_entry(m, path, fix=REMOVED_FIX)
        except PoolCorrupt as e:
            problem = str(e)
        else:
            return m, None
        # the bytes read are the entry's still (not removed and imported again, whole,
        # by another run while this one read for seconds); the rest of the window is
        # the few microseconds to the index lock
        if _file_id(path) != read:
            continue
        try:
            pool.remove(m.digest, force=True)
        except PoolEntryNotFound:
            pass  # removed meanwhile (another run found it damaged too)
        return m, problem
    return m, None  # replaced twice while read: whoever replaced it checks it
