"""Capacity accounting: what each entry takes and which entries to evict for a new one.

Pure decisions over a listing of entries and the locked index state; the store does
the deleting. No torch, no file system access here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spswap.errors import PoolFull
from spswap.liveness import Holder
from spswap.pool.index import IndexState
from spswap.pool.manifest import Manifest
from spswap.units import fmt_bytes


@dataclass(frozen=True)
class EntryInfo:
    """One entry as ``spswap pool ls`` shows it."""

    manifest: Manifest
    path: Path
    size_bytes: int  # on disk: data.bin + manifest.json
    last_used: float
    users: list[Holder]  # live ones only

    def to_json(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "name": m.name, "digest": m.digest, "path": str(self.path),
            "size_bytes": self.size_bytes, "data_size_bytes": m.data_size_bytes,
            "tensor_count": len(m.tensors), "created": m.created, "last_used": self.last_used,
            "users": [h.to_json() for h in self.users],
            "sources": [s.to_json() for s in m.sources], "identity": m.identity,
        }  # fmt: skip


def plan_eviction(
    infos: Sequence[EntryInfo], state: IndexState, size_bytes: int, *,
    capacity_bytes: int, fs_free_bytes: int, exclude: str | None,
) -> list[EntryInfo]:  # fmt: skip
    """The least-recently-used entries without live users to evict so that ``size_bytes``
    fit both under ``capacity_bytes`` (less room reserved for other builds than
    ``exclude``) and in the file system's ``fs_free_bytes``; oldest first.

    Raises :class:`PoolFull` when even evicting every unused entry would not be enough.
    """
    used = sum(e.size_bytes for e in infos)
    reserved = state.reserved_bytes(exclude=exclude)
    free = capacity_bytes - used - reserved
    fs_free = fs_free_bytes
    plan: list[EntryInfo] = []
    # Oldest first; in-use entries (per the locked, pruned state) are never candidates.
    for e in sorted(infos, key=lambda e: e.last_used):
        if free >= size_bytes and fs_free >= size_bytes:
            break
        rec = state.entries.get(e.manifest.digest)
        if rec and rec.uses:
            continue
        plan.append(e)
        free += e.size_bytes
        fs_free += e.size_bytes
    if free < size_bytes or fs_free < size_bytes:
        raise full_error(state, infos, size_bytes, min(free, fs_free), capacity_bytes)
    return plan


def full_error(
    state: IndexState, infos: Sequence[EntryInfo], size_bytes: int, free_bytes: int,
    capacity_bytes: int,
) -> PoolFull:  # fmt: skip
    """The :class:`PoolFull` that says who holds the entries that could not be evicted."""
    in_use = []
    for e in infos:
        rec = state.entries.get(e.manifest.digest)
        if rec and rec.uses:
            who = "; ".join(h.describe() for h in rec.uses)
            in_use.append(f"{e.manifest.name} ({e.manifest.digest[:12]}, "
                          f"{fmt_bytes(e.size_bytes)}) used by {who}")  # fmt: skip
    held = "; ".join(in_use) or "none"
    free_now = max(capacity_bytes - sum(e.size_bytes for e in infos) - state.reserved_bytes(), 0)
    return PoolFull(
        f"pool full: need {fmt_bytes(size_bytes)}, capacity {fmt_bytes(capacity_bytes)}, "
        f"{fmt_bytes(free_now)} free and not enough unused entries to evict. In use: "
        f"{held}. Wait for those users to finish, remove entries with "
        "'spswap pool rm REF', or raise SPSWAP_POOL_CAPACITY_BYTES",
        needed_bytes=size_bytes, free_bytes=max(free_bytes, 0),
    )  # fmt: skip
