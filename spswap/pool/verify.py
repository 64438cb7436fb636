"""Check a pool entry against its manifest: file size, layout, digest and every checksum."""

from __future__ import annotations

import os
from pathlib import Path

from spswap.errors import PoolCorrupt
from spswap.pool.copy import Range, ShortRead, hash_ranges
from spswap.pool.manifest import Manifest, content_digest


def verify_entry(manifest: Manifest, data_path: Path) -> None:
    """Raise :class:`PoolCorrupt` (with ``tensor`` set where one is to blame) on any mismatch."""
    fix = f"remove it (spswap pool rm {manifest.digest[:12]}) and import it again"
    label = f"pool entry {manifest.name} ({manifest.digest[:12]})"
    if content_digest(manifest.tensors) != manifest.digest:
        raise PoolCorrupt(f"{label}: manifest does not match its digest; {fix}")
    try:
        fd = os.open(data_path, os.O_RDONLY)
    except FileNotFoundError:
        raise PoolCorrupt(f"{label}: {data_path} is missing; {fix}") from None
    try:
        size = os.fstat(fd).st_size
        if size != manifest.data_size_bytes:
            raise PoolCorrupt(f"{label}: {data_path} has {size} bytes, the manifest says "
                              f"{manifest.data_size_bytes}; {fix}")  # fmt: skip
        ranges = [Range(t.name, fd, t.offset, t.size_bytes) for t in manifest.tensors]
        try:
            got = hash_ranges(ranges)
        except ShortRead:  # pragma: no cover - the size check above catches it first
            raise PoolCorrupt(f"{label}: {data_path} is shorter than its tensors; {fix}") from None
    finally:
        os.close(fd)
    for t in sorted(manifest.tensors, key=lambda t: t.offset):
        if got[t.name] != t.checksum:
            raise PoolCorrupt(
                f"{label}: tensor {t.name!r} (bytes {t.offset}..{t.offset + t.size_bytes} of "
                f"{data_path}) does not match its checksum; {fix}",
                tensor=t.name,
            )
