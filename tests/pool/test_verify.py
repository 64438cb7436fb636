"""``verify`` recomputes checksums and names the first bad tensor."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from spswap.errors import PoolCorrupt, PoolEntryNotFound, PoolError
from spswap.pool.store import Pool

from .st_files import tensors, write_st


@pytest.fixture
def imported(tmp_path: Path) -> tuple[Pool, str]:
    pool = Pool(tmp_path / "pool", capacity_bytes=64 << 20)
    m = pool.import_checkpoint(write_st(tmp_path / "m.safetensors", tensors(scale=4)))
    return pool, m.digest


@pytest.mark.parametrize("victim", ["layers.0.weight", "embed.weight", "step"])
def test_flipped_byte_names_tensor(imported: tuple[Pool, str], victim: str) -> None:
    pool, digest = imported
    m = pool.find(digest)
    t = m.by_name()[victim]
    path = pool.data_path(m)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(t.offset + t.size_bytes // 2)
        b = f.read(1)
        f.seek(t.offset + t.size_bytes // 2)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(PoolCorrupt) as e:
        pool.verify(digest[:8])
    assert e.value.tensor == victim
    assert repr(victim) in str(e.value) and "spswap pool rm" in str(e.value)


def test_truncated_data_file(imported: tuple[Pool, str]) -> None:
    pool, digest = imported
    m = pool.find(digest)
    os.truncate(pool.data_path(m), m.data_size_bytes - 4096)
    with pytest.raises(PoolCorrupt, match="has .* bytes, the manifest says"):
        pool.verify(digest)


def test_find_by_name_prefix_and_errors(imported: tuple[Pool, str], tmp_path: Path) -> None:
    pool, digest = imported
    assert pool.find("m").digest == digest == pool.find(digest[:6]).digest
    with pytest.raises(PoolEntryNotFound, match=f"m \\({digest[:12]}\\)"):
        pool.find("other")
    with pytest.raises(PoolEntryNotFound):
        pool.find(digest[:5])  # too short to be a prefix
    pool.import_checkpoint(write_st(tmp_path / "m2.safetensors", tensors(9)), name="m")
    with pytest.raises(PoolError, match="2 pool entries are named 'm'"):
        pool.find("m")


def test_a_name_cannot_shadow_a_digest(tmp_path):
    """Names are chosen by whoever imports (users too, through spswapd): an entry named
    like another entry's digest must not be what a lookup by that digest returns."""
    import struct

    from spswap.pool.store import Pool

    def ckpt(path, value):
        raw = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + struct.pack("<f", value))
        return path

    pool = Pool(tmp_path / "pool")
    victim = pool.import_checkpoint(ckpt(tmp_path / "a.safetensors", 1.0), name="victim")
    with pytest.raises(PoolError, match="looks like a digest"):
        pool.import_checkpoint(ckpt(tmp_path / "b.safetensors", 2.0), name=victim.digest)
    fake = pool.import_checkpoint(ckpt(tmp_path / "b.safetensors", 2.0), name="fake")
    assert pool.find(victim.digest) == victim
    assert pool.find(fake.digest) == fake


def test_a_damaged_entry_is_removed_and_a_whole_one_stays(imported: tuple[Pool, str]) -> None:
    from spswap.pool.verify import REMOVED_FIX, remove_if_damaged
    from tests.helpers.damage import reverse_largest_tensor

    pool, digest = imported
    assert remove_if_damaged(pool, digest)[1] is None and pool.find(digest)
    reverse_largest_tensor(pool, pool.find(digest))
    m, problem = remove_if_damaged(pool, digest)
    assert m.digest == digest and problem is not None and problem.endswith(REMOVED_FIX)
    with pytest.raises(PoolEntryNotFound):
        pool.find(digest)


def test_an_entry_replaced_while_it_was_read_is_read_again_not_removed(
    imported: tuple[Pool, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another run removed the damaged entry and imported it again, whole, while this
    check read the damaged bytes: the whole entry stays (before, it was removed)."""
    from spswap.pool import verify
    from tests.helpers.damage import reverse_largest_tensor

    pool, digest = imported
    reverse_largest_tensor(pool, pool.find(digest))
    real = verify.verify_entry
    calls = []

    def read_while_replaced(manifest, path, **kw):  # type: ignore[no-untyped-def]
        calls.append(path)
        if len(calls) == 1:
            try:
                real(manifest, path, **kw)  # the damaged bytes, read
            finally:  # meanwhile: removed and imported again, whole
                pool.remove(digest, force=True)
                pool.import_checkpoint(write_st(tmp_path / "again.safetensors", tensors(scale=4)))
        return real(manifest, path, **kw)

    monkeypatch.setattr(verify, "verify_entry", read_while_replaced)
    assert verify.remove_if_damaged(pool, digest)[1] is None
    assert len(calls) == 2
    pool.verify(digest)  # there, and whole


def test_a_damaged_entry_in_use_names_its_users(imported: tuple[Pool, str]) -> None:
    """The jobs that use a damaged entry read its pages: verify says who they are."""
    pool, digest = imported
    m = pool.find(digest)
    path = pool.data_path(m)
    os.chmod(path, 0o644)
    t = m.by_name()["embed.weight"]
    with pool.use(digest):
        with open(path, "r+b") as f:
            f.seek(t.offset)
            f.write(b"\xff\xfe")
        with pytest.raises(PoolCorrupt) as e:
            pool.verify(digest)
        who = tuple(h.describe() for h in pool.index.read_unlocked().entries[digest].uses)
    assert e.value.tensor == "embed.weight"
    assert f"; it is in use by pid {os.getpid()}" in str(e.value), str(e.value)
    assert e.value.users == who and len(who) == 1
    assert str(e.value).endswith(
        "one on a GPU copies them at its next wake); as root, end those jobs (scancel) and "
        f"remove it (spswap pool rm {digest[:12]}), or remove it now (spswap pool rm "
        f"{digest[:12]} --force: they run on but cannot be checkpointed); the next job that "
        "runs the model imports it again from its files"
    ), str(e.value)
    with pytest.raises(PoolCorrupt) as e:  # no user left: the damage alone
        pool.verify(digest)
    assert "in use by" not in str(e.value)
