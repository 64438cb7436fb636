"""Hash (and optionally copy) byte ranges of files in parallel, with large buffered reads.

``hashlib`` and ``os.preadv`` release the GIL on large buffers, so a few threads keep
several cores busy hashing. A copy reads straight into the destination's mapping (one
copy, no write() through the file's inode lock) and hashes the bytes while they are
still in cache, so chunks are a few MiB, not larger. Used by the import (source ->
data.bin) and by ``verify`` (data.bin only).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

CHUNK_BYTES = 4 << 20
MAX_THREADS = 8
PROGRESS_INTERVAL_S = 0.1


class ShortRead(Exception):
    """The source ended before the range did (file truncated after its header was read)."""

    def __init__(self, fd: int, offset: int) -> None:
        super().__init__(f"end of file at byte {offset}")
        self.fd, self.offset = fd, offset


@dataclass(frozen=True)
class Range:
    """``size_bytes`` bytes at ``src_offset`` of ``src_fd``; written to ``dst_offset``
    of the destination when there is one."""

    key: str
    src_fd: int
    src_offset: int
    size_bytes: int
    dst_offset: int = 0


def hash_ranges(
    ranges: Sequence[Range], *, dst: memoryview | None = None,
    progress: Callable[[int, int], None] | None = None, threads: int | None = None,
) -> dict[str, str]:  # fmt: skip
    """``{key: "sha256:<hex>"}`` of every range; copies each into ``dst`` (a writable
    mapping, bytes at ``dst_offset``) if given.

    The first failure (e.g. :class:`ShortRead`) stops the remaining work and is raised.
    """
    total = sum(r.size_bytes for r in ranges)
    done = [0]
    lock = threading.Lock()
    stop = threading.Event()
    local = threading.local()

    def one(r: Range) -> tuple[str, str]:
        buf = dst
        base = r.dst_offset
        if buf is None:
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = memoryview(bytearray(CHUNK_BYTES))
            base = 0
        h = hashlib.sha256()
        pos = 0
        while pos < r.size_bytes and not stop.is_set():
            at = base + (pos if dst is not None else 0)
            want = min(CHUNK_BYTES, r.size_bytes - pos)
            got = os.preadv(r.src_fd, [buf[at : at + want]], r.src_offset + pos)
            if got <= 0:
                raise ShortRead(r.src_fd, r.src_offset + pos)
            h.update(buf[at : at + got])
            pos += got
            with lock:
                done[0] += got
        return r.key, "sha256:" + h.hexdigest()

    n_threads = threads or min(MAX_THREADS, os.cpu_count() or 1, max(len(ranges), 1))
    results: dict[str, str] = {}
    # Largest first, so one big tensor does not start last and run alone.
    order = sorted(ranges, key=lambda r: -r.size_bytes)
    with ThreadPoolExecutor(max_workers=n_threads, thread_name_prefix="spswap-hash") as pool:
        pending: set[Future[tuple[str, str]]] = {pool.submit(one, r) for r in order}
        try:
            while pending:
                finished, pending = wait(pending, PROGRESS_INTERVAL_S, FIRST_EXCEPTION)
                for f in finished:
                    key, digest = f.result()
                    results[key] = digest
                if progress is not None:
                    progress(done[0], total)
        except BaseException:
            stop.set()
            for f in pending:
                f.cancel()
            raise
    if progress is not None:
        progress(total, total)
    return results
