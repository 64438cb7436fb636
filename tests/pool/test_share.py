"""One user's share of the pool (SPSWAP_POOL_USER_BYTES) on a real pool directory: the
entries a user imported count in their share, an import over it makes room from that
user's own oldest entries, and an entry another user imported too stays for them.

In-process as root, with the importing uid given as spswapd gives it; the same through
a real spswapd and a second uid is tests/security/test_pool_share.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spswap.errors import PoolFull
from spswap.liveness import Holder
from spswap.pool.manifest import Manifest
from spswap.pool.store import Pool

from .st_files import tensors, write_st

ALICE, BOB = 1001, 1002
_DTYPES = {"float32": "F32", "float16": "F16", "int64": "I64"}


@pytest.fixture
def entry_bytes(tmp_path: Path) -> int:
    probe = Pool(tmp_path / "probe")
    probe.import_checkpoint(write_st(tmp_path / "probe.safetensors", tensors(99)), name="m99")
    return probe.entries()[0].size_bytes


def _pool(tmp_path: Path, entry_bytes: int, uid: int | None) -> Pool:
    # room for 10 entries; each user's share 2.5 of them
    return Pool(tmp_path / "pool", capacity_bytes=10 * entry_bytes, importer_uid=uid,
                user_bytes=5 * entry_bytes // 2)  # fmt: skip


def _import(pool: Pool, tmp_path: Path, seed: int, file: str = "") -> Manifest:
    src = write_st(tmp_path / f"{file or seed}.safetensors", tensors(seed))
    return pool.import_checkpoint(src, name=f"m{seed}")


def _names(pool: Pool) -> set[str]:
    return {e.manifest.name for e in pool.entries()}


def test_a_users_imports_make_room_in_their_own_share(tmp_path: Path, entry_bytes: int) -> None:
    root = _pool(tmp_path, entry_bytes, None)
    alice = _pool(tmp_path, entry_bytes, ALICE)
    _import(root, tmp_path, 1)
    for seed in (2, 3, 4):  # the third is over Alice's share: her oldest goes, not root's
        _import(alice, tmp_path, seed)
    assert _names(root) == {"m1", "m3", "m4"}
    by_name = {e.manifest.name: e.importers for e in root.entries()}
    assert by_name == {"m1": [], "m3": [ALICE], "m4": [ALICE]}
    with alice.use("m3"), alice.use("m4"):
        with pytest.raises(PoolFull, match=r"^your share of the pool is full: uid 1001's"):
            _import(alice, tmp_path, 5)
    assert _names(root) == {"m1", "m3", "m4"}  # the refused import changed nothing
    assert alice.user_bytes == 5 * entry_bytes // 2 and root.importer_uid is None


def test_bytes_two_users_imported_stay_for_the_other(tmp_path: Path, entry_bytes: int) -> None:
    alice = _pool(tmp_path, entry_bytes, ALICE)
    bob = _pool(tmp_path, entry_bytes, BOB)
    shared = _import(alice, tmp_path, 1, "alice-copy")
    assert _import(bob, tmp_path, 1, "bob-copy").digest == shared.digest  # same bytes
    _import(alice, tmp_path, 2)
    _import(alice, tmp_path, 3)  # over Alice's share: m1 stops counting in it, stays for Bob
    importers = {e.manifest.name: e.importers for e in alice.entries()}
    assert importers == {"m1": [BOB], "m2": [ALICE], "m3": [ALICE]}


def test_uid_zero_is_no_share_and_the_default_share_is_half(tmp_path: Path) -> None:
    pool = Pool(tmp_path / "pool", capacity_bytes=1000, importer_uid=0)
    assert pool.importer_uid is None and pool.user_bytes == 500


def test_an_entry_only_another_user_uses_moves_to_their_share(
    tmp_path: Path, entry_bytes: int
) -> None:
    alice = _pool(tmp_path, entry_bytes, ALICE)
    m1 = _import(alice, tmp_path, 1)
    bob = Holder(pid=os.getpid(), pid_start=None, uid=BOB, job_id=None)
    alice.acquire_use(m1.digest, bob)  # Bob's process maps Alice's m1
    _import(alice, tmp_path, 2)
    _import(alice, tmp_path, 3)  # over Alice's share: m1 stays (in use), on Bob's share
    importers = {e.manifest.name: e.importers for e in alice.entries()}
    assert importers == {"m1": [BOB], "m2": [ALICE], "m3": [ALICE]}


def _empty_tensors(w: object, count: int, tag: str) -> None:
    for i in range(count):  # no data: only the manifest grows (a name each)
        w.add(f"{tag}.{i}." + "x" * 1000, "F32", (0,), b"")  # type: ignore[attr-defined]


def test_a_build_larger_than_it_reserved_makes_room_for_all_it_holds(
    tmp_path: Path, entry_bytes: int
) -> None:
    """The bounds hold for what is published, not for what a build reserved: its data is
    checked against the reservation, but its manifest grows with its tensors' names
    (before, this entry reserved 8 KiB and was published past alice's share)."""
    pool = _pool(tmp_path, entry_bytes, ALICE)
    _import(pool, tmp_path, 1)
    _import(pool, tmp_path, 2)
    count = entry_bytes // 2 // 1000
    with pool.writer("names", expected_size_bytes=1) as w:
        _empty_tensors(w, count, "a")
    assert _names(pool) == {"m2", "names"}  # m1 (the older) made room in alice's share
    assert sum(e.size_bytes for e in pool.entries()) <= pool.user_bytes
    with pytest.raises(PoolFull), pool.writer("more", expected_size_bytes=1) as w:
        _empty_tensors(w, 6 * count, "b")
    assert _names(pool) == {"m2", "names"}
    assert [p.name for p in pool.pool_dir.iterdir() if p.name.startswith(".tmp")] == []
