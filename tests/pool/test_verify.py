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
