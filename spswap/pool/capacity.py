"""Capacity accounting: what each entry takes and which entries to evict for a new one.

Pure decisions over a listing of entries and the locked index state; the store does
the deleting. No torch, no file system access here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
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
    importers: list[int] = field(default_factory=list)  # whose share it counts in

    def to_json(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "name": m.name, "digest": m.digest, "path": str(self.path),
            "size_bytes": self.size_bytes, "data_size_bytes": m.data_size_bytes,
            "tensor_count": len(m.tensors), "created": m.created, "last_used": self.last_used,
            "users": [h.to_json() for h in self.users], "importers": sorted(self.importers),
            "sources": [s.to_json() for s in m.sources], "identity": m.identity,
        }  # fmt: skip


@dataclass(frozen=True)
class UserShare:
    """One user's share of the pool: what the entries they imported through spswapd
    (and their builds under way) may hold together."""

    uid: int
    budget_bytes: int


@dataclass(frozen=True)
class EvictionPlan:
    """What to do before a new entry of some size goes in."""

    evict: list[EntryInfo]
    """Entries to delete, oldest first."""
    release: list[str]
    """Digests that stop counting in the importing user's share and stay: another user
    imported the same bytes too, or only other users' processes use it (it moves onto
    their share)."""
    for_share: frozenset[str] = frozenset()
    """Of :attr:`evict`, the digests that go for the user's share (the rest for the
    pool's capacity or its file system)."""


def imported_bytes(infos: Sequence[EntryInfo], uid: int) -> int:
    """What the entries ``uid`` imported hold (as listed: their share, without builds)."""
    return sum(e.size_bytes for e in infos if uid in e.importers)


def user_charge_bytes(
    infos: Sequence[EntryInfo], state: IndexState, uid: int, *, exclude: str | None = None
) -> int:
    """What ``uid``'s share holds: the entries it imported and its builds under way
    (but ``exclude``, the caller's own)."""
    entries = sum(e.size_bytes for e in infos if uid in _importers(state, e))
    builds = sum(r.size_bytes for k, r in state.reservations.items()
                 if r.uid == uid and k != exclude)  # fmt: skip
    return entries + builds


def plan_eviction(
    infos: Sequence[EntryInfo], state: IndexState, size_bytes: int, *,
    capacity_bytes: int, fs_free_bytes: int, exclude: str | None,
    user: UserShare | None = None,
) -> EvictionPlan:  # fmt: skip
    """How ``size_bytes`` fit: first in ``user``'s share (their own least recently used
    entries no job uses go, or stop counting where another user imported them too), then
    under ``capacity_bytes`` (less room reserved for other builds than ``exclude``) and
    in the file system's ``fs_free_bytes`` (any user's least recently used entries no
    job uses go); oldest first.

    Raises :class:`PoolFull` when even that would not be enough; nothing is planned then.
    """
    evict: list[EntryInfo] = []
    release: list[str] = []
    if user is not None:
        evict, release = _plan_share(infos, state, size_bytes, user, exclude)
    used = sum(e.size_bytes for e in infos)
    reserved = state.reserved_bytes(exclude=exclude)
    gone = sum(e.size_bytes for e in evict)
    free = capacity_bytes - used - reserved + gone
    fs_free = fs_free_bytes + gone
    for_share = frozenset(e.manifest.digest for e in evict)
    more: list[EntryInfo] = []
    # Oldest first; in-use entries (per the locked, pruned state) are never candidates.
    for e in sorted(infos, key=lambda e: e.last_used):
        if free >= size_bytes and fs_free >= size_bytes:
            break
        if e in evict or _in_use(state, e):
            continue
        more.append(e)
        free += e.size_bytes
        fs_free += e.size_bytes
    if free < size_bytes or fs_free < size_bytes:
        raise full_error(state, infos, size_bytes, min(free, fs_free), capacity_bytes)
    for e in list(more):  # an older one the newer made unneeded stays
        if free - e.size_bytes >= size_bytes and fs_free - e.size_bytes >= size_bytes:
            more.remove(e)
            free -= e.size_bytes
            fs_free -= e.size_bytes
    return EvictionPlan(evict + more, release, for_share)


def _plan_share(
    infos: Sequence[EntryInfo], state: IndexState, size_bytes: int, user: UserShare,
    exclude: str | None,
) -> tuple[list[EntryInfo], list[str]]:  # fmt: skip
    charged = user_charge_bytes(infos, state, user.uid, exclude=exclude)
    evict: list[EntryInfo] = []
    release: list[str] = []
    for e in sorted(infos, key=lambda e: e.last_used):
        if charged + size_bytes <= user.budget_bytes:
            break
        importers = _importers(state, e)
        if user.uid not in importers or _used_by(state, e, user.uid):
            continue
        if importers - {user.uid} or _in_use(state, e):
            # another user imported it too, or only others use it (a use of another's
            # entry must not lock its importer's share): it stays, off this share
            release.append(e.manifest.digest)
        else:
            evict.append(e)
        charged -= e.size_bytes
    if charged + size_bytes > user.budget_bytes:
        raise share_full_error(state, infos, size_bytes, user, exclude)
    for e in list(evict):  # an older one the newer made unneeded stays
        if charged + e.size_bytes + size_bytes <= user.budget_bytes:
            evict.remove(e)
            charged += e.size_bytes
    for digest in list(release):
        size = next(e.size_bytes for e in infos if e.manifest.digest == digest)
        if charged + size + size_bytes <= user.budget_bytes:
            release.remove(digest)
            charged += size
    return evict, release


def _importers(state: IndexState, e: EntryInfo) -> set[int]:
    rec = state.entries.get(e.manifest.digest)
    return set(rec.importers) if rec else set()


def _in_use(state: IndexState, e: EntryInfo) -> bool:
    rec = state.entries.get(e.manifest.digest)
    return bool(rec and rec.uses)


def _used_by(state: IndexState, e: EntryInfo, uid: int) -> bool:
    """In use by ``uid``'s processes or jobs, or by root's (spswapd's for a checkpoint
    image, the prolog's): uses that keep it in its importer's share; another user's do
    not (a use of someone else's entry must not lock their share)."""
    rec = state.entries.get(e.manifest.digest)
    return rec is not None and any(h.uid in (uid, 0) for h in rec.uses)


def users_of(state: IndexState, digest: str) -> set[int]:
    """The users (not root) whose processes or jobs use entry ``digest`` now."""
    rec = state.entries.get(digest)
    return {h.uid for h in rec.uses if h.uid != 0} if rec else set()


def share_full_error(
    state: IndexState, infos: Sequence[EntryInfo], size_bytes: int, user: UserShare,
    exclude: str | None,
) -> PoolFull:  # fmt: skip
    """The :class:`PoolFull` of a user's share: what it holds and what keeps it full."""
    charged = user_charge_bytes(infos, state, user.uid, exclude=exclude)
    held = [f"{e.manifest.name} ({e.manifest.digest[:12]}, {fmt_bytes(e.size_bytes)}) used "
            f"by {'; '.join(h.describe() for h in state.entries[e.manifest.digest].uses)}"
            for e in infos
            if user.uid in _importers(state, e) and _used_by(state, e, user.uid)]  # fmt: skip
    building = sum(r.size_bytes for k, r in state.reservations.items()
                   if r.uid == user.uid and k != exclude)  # fmt: skip
    if size_bytes > user.budget_bytes:
        return PoolFull(
            f"your share of the pool cannot hold it: it needs {fmt_bytes(size_bytes)}, more "
            f"than all of SPSWAP_POOL_USER_BYTES={fmt_bytes(user.budget_bytes)} (uid "
            f"{user.uid}); ask the node's admin to raise SPSWAP_POOL_USER_BYTES, or use a "
            "smaller model",
            needed_bytes=size_bytes, free_bytes=max(user.budget_bytes - charged, 0),
        )  # fmt: skip
    why = f"your entries in use: {'; '.join(held) or 'none'}" + (
        f"; your imports under way: {fmt_bytes(building)}" if building else ""
    )
    for_images = any(h.purpose == "image" for e in infos if user.uid in _importers(state, e)
                     for h in state.entries[e.manifest.digest].uses)  # fmt: skip
    return PoolFull(
        f"your share of the pool is full: uid {user.uid}'s imports hold "
        f"{fmt_bytes(charged)} of SPSWAP_POOL_USER_BYTES={fmt_bytes(user.budget_bytes)}, and "
        f"this import of {fmt_bytes(size_bytes)} would take it "
        f"{fmt_bytes(charged + size_bytes - user.budget_bytes)} over ({why}). Your entries "
        "that no job uses make room by themselves: wait for your jobs that use them to end"
        + (" (one held for a job's checkpoint image is let go when that job runs again, "
           "or when you cancel it: scancel JOB)" if for_images else "")
        + ", or ask the node's admin to raise SPSWAP_POOL_USER_BYTES",
        needed_bytes=size_bytes, free_bytes=max(user.budget_bytes - charged, 0),
    )  # fmt: skip


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
