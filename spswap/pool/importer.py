"""``spswap pool import``: read a safetensors checkpoint once into one pool entry.

Order of work, so that bad input never touches the pool: resolve and validate every
header first; then, under a lock per source (so a second importer of the same files
waits and reuses the first one's entry), reuse an entry imported from the very same
files (path, size, mtime) without reading any data, or copy every tensor into a new
entry through :class:`~spswap.pool.writer.EntryWriter`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock

from spswap.errors import InvalidCheckpoint
from spswap.pool.copy import Range, ShortRead, hash_ranges
from spswap.pool.manifest import Manifest, padded_size_bytes
from spswap.pool.safetensors_format import Checkpoint, resolve_checkpoint

if TYPE_CHECKING:
    from spswap.pool.store import Pool


def import_checkpoint(
    pool: Pool, path: Path, *, name: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Manifest:  # fmt: skip
    """Import ``path`` (a .safetensors file or a checkpoint directory); returns its manifest."""
    from spswap.pool.store import source_key

    ckpt = resolve_checkpoint(path)
    sources = ckpt.sources
    pool.ensure_dirs()
    with FileLock(str(pool.index.lock_path(f"import-{source_key(sources)}.lock"))):
        hit = pool.find_by_sources(sources)
        if hit is not None:
            return hit
        expected = padded_size_bytes(t.size_bytes for _f, t in ckpt.tensors)
        with pool.writer(name or ckpt.name, sources=sources, expected_size_bytes=expected) as w:
            _copy(ckpt, w, progress)
            _check_unchanged(ckpt)
        assert w.manifest is not None
        pool.remember_sources(sources, w.manifest.digest)
        return w.manifest


def _copy(ckpt: Checkpoint, w: object, progress: Callable[[int, int], None] | None) -> None:
    from spswap.pool.writer import EntryWriter

    assert isinstance(w, EntryWriter)
    with ExitStack() as stack:
        fds: dict[Path, int] = {}
        for f in ckpt.files:
            fds[f.path] = os.open(f.path, os.O_RDONLY)
            stack.callback(os.close, fds[f.path])
        names: dict[int, str] = {fd: str(p) for p, fd in fds.items()}
        ranges = []
        for f, t in ckpt.tensors:
            offset, _size = w.place(t.name, t.dtype, t.shape)
            ranges.append(Range(t.name, fds[f.path], t.file_offset, t.size_bytes, offset))
        try:
            dst = w.data_view() if ranges and w.expected_size_bytes else None
            checksums = hash_ranges(ranges, dst=dst, progress=progress)
        except ShortRead as e:
            raise InvalidCheckpoint(
                f"{names[e.fd]}: ends at byte {e.offset}, before the data its header "
                "describes (truncated while importing); check the file and import again"
            ) from None
        for _f, t in ckpt.tensors:
            w.commit(t.name, checksums[t.name])


def _check_unchanged(ckpt: Checkpoint) -> None:
    for s in ckpt.sources:
        try:
            st = os.stat(s.path)
        except FileNotFoundError:
            raise InvalidCheckpoint(f"{s.path}: removed while importing; import again") from None
        if (st.st_size, st.st_mtime_ns) != (s.size_bytes, s.mtime_ns):
            raise InvalidCheckpoint(
                f"{s.path}: changed while importing (size or mtime differ); import again "
                "once nothing writes to it"
            )
