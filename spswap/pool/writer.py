"""Build one pool entry in a temporary directory and rename it into place when complete.

:class:`EntryWriter` is how anything gets into the pool: the safetensors import and an
engine exporting its weights from whatever buffers it has. Tensors go into one flat
``data.bin``, each at a multiple of :data:`ALIGNMENT_BYTES`, hashed as they are
written. Until the rename nothing is visible under a digest; on an exception the temp
dir and its space reservation go away, so the pool is left as it was.
"""

from __future__ import annotations

import errno
import hashlib
import math
import mmap
import os
import shutil
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from spswap.errors import PoolError, PoolFull
from spswap.fsutil import atomic_write_json
from spswap.liveness import Holder
from spswap.pool.layout import DATA_FILE, DIR_MODE, FILE_MODE, MANIFEST_FILE, tmp_dir_name
from spswap.pool.manifest import (
    ALIGNMENT_BYTES,
    DTYPE_SIZES,
    Manifest,
    SourceFile,
    TensorEntry,
    align_up,
    content_digest,
)
from spswap.pool.names import check_entry_name


class EntryStore(Protocol):
    """What a writer needs from the pool it builds an entry in (:class:`~spswap.pool.store.
    Pool` is one): room held for the temp dir while it fills, and the publication."""

    @property
    def pool_dir(self) -> Path: ...

    def remove_stale_tmp_dirs(self) -> list[str]:
        """Delete temp dirs whose builder died."""
        ...

    def reserve_room(self, name: str, size_bytes: int, holder: Holder) -> list[str]:
        """Evict as needed and hold ``size_bytes`` for temp dir ``name``; the evicted digests."""
        ...

    def release_reservation(self, name: str) -> None:
        """Drop the room held for temp dir ``name``."""
        ...

    def publish(self, tmp: Path, manifest: Manifest, reservation: str) -> tuple[Manifest, bool]:
        """Rename the finished ``tmp`` into place: ``(manifest, reused)``."""
        ...


class EntryWriter:
    """Context manager that writes one entry; ``w.manifest`` holds the result after exit.

    Use :meth:`Pool.writer` to make one. ``add`` appends a tensor from any bytes-like
    buffer (numpy array, memoryview, mmap slice); ``add_chunks`` streams one tensor
    from an iterable of buffers.
    """

    def __init__(
        self, pool: EntryStore, name: str, *, identity: dict[str, Any] | None = None,
        sources: Sequence[SourceFile] = (), expected_size_bytes: int | None = None,
    ) -> None:  # fmt: skip
        check_entry_name(name)  # every entry is written here, whoever imports it
        self.pool = pool
        self.name = name
        self.identity = dict(identity or {})
        self.sources = tuple(sources)
        self.expected_size_bytes = expected_size_bytes
        self.manifest: Manifest | None = None
        self.evicted: list[str] = []
        self.reused = False
        self._holder = Holder.current()
        self._tmp: Path | None = None
        self._fd = -1
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._end = 0  # first free byte in data.bin
        self._reserved = 0
        self._tensors: dict[str, TensorEntry] = {}
        self._pending: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        self._lock = threading.Lock()

    def data_view(self) -> memoryview:
        """A writable mapping of the preallocated data.bin (needs ``expected_size_bytes``).

        Fill placed regions through it (``view[offset : offset + size]``), then
        :meth:`commit`; the mapping is closed before the entry is published.
        """
        if not self.expected_size_bytes:
            raise PoolError("data_view needs a writer opened with expected_size_bytes > 0")
        if self._view is None:
            self._map = mmap.mmap(self._fd, align_up(self.expected_size_bytes))
            self._view = memoryview(self._map)
        return self._view

    def _unmap(self) -> None:
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._map is not None:
            self._map.close()
            self._map = None

    @property
    def tmp_dir(self) -> Path:
        if self._tmp is None:
            raise PoolError("the entry writer is not open; use it as a context manager")
        return self._tmp

    # -- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> EntryWriter:
        self.pool.remove_stale_tmp_dirs()
        name = tmp_dir_name(self._holder)
        if self.expected_size_bytes is not None:
            self._reserve(name, align_up(self.expected_size_bytes) + ALIGNMENT_BYTES)
        try:
            self._tmp = self.pool.pool_dir / name
            self._tmp.mkdir(mode=DIR_MODE)
            self._fd = os.open(self._tmp / DATA_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL, FILE_MODE)
            if self.expected_size_bytes:
                self._preallocate(align_up(self.expected_size_bytes))
        except BaseException:
            self._abort()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        if exc_type is not None:
            self._abort()
            return
        try:
            self._finish()
        except BaseException:
            self._abort()
            raise

    def _reserve(self, name: str, size_bytes: int) -> None:
        self.evicted = self.pool.reserve_room(name, size_bytes, self._holder)
        self._reserved = size_bytes

    def _preallocate(self, size_bytes: int) -> None:
        try:
            # the size first: a tmpfs mounted huge=within_size gives huge pages only within
            # the file's size, which an older kernel's fallocate sets only at its end
            os.ftruncate(self._fd, size_bytes)
            os.posix_fallocate(self._fd, 0, size_bytes)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            free = shutil.disk_usage(self.pool.pool_dir).free
            raise PoolFull(
                f"the file system under {self.pool.pool_dir} has {free} bytes free but the "
                f"entry needs {size_bytes}; free space there (spswap pool rm) or lower "
                "SPSWAP_POOL_CAPACITY_BYTES to what the file system can hold",
                needed_bytes=size_bytes,
                free_bytes=free,
            ) from None

    # -- writing tensors ---------------------------------------------------------------

    def place(self, name: str, dtype: str, shape: Sequence[int]) -> tuple[int, int]:
        """Reserve the aligned region for a tensor: ``(offset, size_bytes)``. Thread-safe."""
        if dtype not in DTYPE_SIZES:
            raise PoolError(f"tensor {name!r}: unknown dtype {dtype!r}; use one of "
                            f"{', '.join(DTYPE_SIZES)}")  # fmt: skip
        size = math.prod(shape) * DTYPE_SIZES[dtype]
        with self._lock:
            if name in self._tensors or name in self._pending:
                raise PoolError(f"tensor {name!r} added twice to entry {self.name!r}")
            offset = align_up(self._end)
            self._end = offset + size
            self._pending[name] = (dtype, tuple(int(d) for d in shape), offset, size)
        return offset, size

    def write_at(self, offset: int, data: Any) -> None:
        """Write ``data`` (bytes-like) at absolute ``offset`` of data.bin. Thread-safe."""
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(self._fd, view, offset)
            view, offset = view[n:], offset + n

    def commit(self, name: str, checksum: str) -> TensorEntry:
        """Record a placed tensor whose bytes are written and hashed. Thread-safe."""
        with self._lock:
            dtype, shape, offset, size = self._pending.pop(name)
            entry = TensorEntry(name, dtype, shape, offset, size, checksum)
            self._tensors[name] = entry
        return entry

    def add_chunks(
        self, name: str, dtype: str, shape: Sequence[int], chunks: Iterable[Any]
    ) -> TensorEntry:
        """Append one tensor whose bytes arrive as consecutive buffers."""
        offset, size = self.place(name, dtype, shape)
        h = hashlib.sha256()
        pos = offset
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            if pos + view.nbytes > offset + size:
                raise PoolError(f"tensor {name!r}: more than the {size} bytes its shape needs")
            h.update(view)
            self.write_at(pos, view)
            pos += view.nbytes
        if pos != offset + size:
            raise PoolError(f"tensor {name!r}: got {pos - offset} bytes, its shape needs {size}")
        return self.commit(name, "sha256:" + h.hexdigest())

    def add(self, name: str, dtype: str, shape: Sequence[int], data: Any) -> TensorEntry:
        """Append one tensor from a C-contiguous bytes-like buffer."""
        view = memoryview(data)
        if not view.c_contiguous:
            raise PoolError(f"tensor {name!r}: buffer is not contiguous; copy it first")
        return self.add_chunks(name, dtype, shape, [view])

    # -- completion --------------------------------------------------------------------

    def _finish(self) -> None:
        if self._pending:
            raise PoolError(f"tensors placed but never committed: {sorted(self._pending)}")
        self._unmap()
        tensors = tuple(sorted(self._tensors.values(), key=lambda t: t.offset))
        data_size = align_up(self._end)
        os.ftruncate(self._fd, data_size)
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        if self._reserved and data_size > self._reserved:
            raise PoolError(
                f"entry {self.name!r} grew to {data_size} bytes, past the "
                f"{self._reserved} reserved for it; pass the real expected size"
            )
        manifest = Manifest(
            name=self.name, digest=content_digest(tensors), data_size_bytes=data_size,
            tensors=tensors, sources=self.sources, created=time.time(),
            identity=self.identity,
        )  # fmt: skip
        tmp = self.tmp_dir
        atomic_write_json(tmp / MANIFEST_FILE, manifest.to_json(), mode=FILE_MODE)
        os.chmod(tmp / DATA_FILE, FILE_MODE)
        os.chmod(tmp, DIR_MODE)
        self.manifest, self.reused = self.pool.publish(tmp, manifest, tmp.name)
        self._tmp = None

    def _abort(self) -> None:
        self._unmap()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            name, self._tmp = self._tmp.name, None
            self.pool.release_reservation(name)
