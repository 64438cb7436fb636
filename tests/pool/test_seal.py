"""An entry's seal: its data file as published or last read whole. A process that asks
to serve from an entry has it read again only once the file changed (a stat otherwise),
so a stray write onto ``data.bin`` is caught at the next start, not served."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from spswap.errors import PoolEntryNotFound
from spswap.pool.index import file_key
from spswap.pool.store import Pool
from spswap.pool.verify import REMOVED_FIX, check_unless_sealed
from tests.helpers.damage import reverse_largest_tensor

from .st_files import tensors, write_st


def _imported(tmp_path: Path) -> tuple[Pool, str]:
    pool = Pool(tmp_path / "pool", capacity_bytes=64 << 20)
    m = pool.import_checkpoint(write_st(tmp_path / "m.safetensors", tensors(scale=4)), name="m")
    return pool, m.digest


def _sealed(pool: Pool, digest: str) -> object:
    return pool.index.read_unlocked().entries[digest].sealed


def _write_over(pool: Pool, digest: str) -> tuple[int, int]:
    """Damage the entry; the data file's times as they were before."""
    path = pool.data_path(pool.find(digest))
    st = os.stat(path)
    os.chmod(path, 0o644)
    reverse_largest_tensor(pool, pool.find(digest))
    return st.st_atime_ns, st.st_mtime_ns


def test_a_published_entry_is_sealed_with_its_data_file(tmp_path: Path) -> None:
    pool, digest = _imported(tmp_path)
    assert _sealed(pool, digest) == file_key(pool.data_path(pool.find(digest)))
    assert check_unless_sealed(pool, digest)[1] is None


def test_a_write_onto_the_file_is_caught_and_the_entry_removed(tmp_path: Path) -> None:
    pool, digest = _imported(tmp_path)
    _write_over(pool, digest)
    os.utime(pool.data_path(pool.find(digest)), ns=(0, 1))  # (a write may fall in its tick)
    m, problem = check_unless_sealed(pool, digest)
    assert problem is not None and problem.startswith(f"pool entry m ({digest[:12]}): tensor ")
    assert problem.endswith(REMOVED_FIX), problem
    assert pool.entries() == []


def test_a_sealed_file_is_not_read_only_stat_ed(tmp_path: Path) -> None:
    # damage that leaves the file's times as they were is not seen (no read): what the
    # seal costs is a stat; `spswap pool verify` and a restore's check prompt read it all
    pool, digest = _imported(tmp_path)
    times = _write_over(pool, digest)
    os.utime(pool.data_path(pool.find(digest)), ns=times)
    assert check_unless_sealed(pool, digest)[1] is None
    assert [e.manifest.digest for e in pool.entries()] == [digest]


def test_a_whole_entry_whose_file_changed_is_read_and_sealed_again(tmp_path: Path) -> None:
    pool, digest = _imported(tmp_path)
    path = pool.data_path(pool.find(digest))
    os.utime(path, ns=(0, 1))
    assert _sealed(pool, digest) != file_key(path)
    assert check_unless_sealed(pool, digest)[1] is None
    assert _sealed(pool, digest) == file_key(path)


def test_an_entry_with_no_seal_is_read_once_then_sealed(tmp_path: Path) -> None:
    # an index written before seals (no "sealed" in its records)
    pool, digest = _imported(tmp_path)
    raw = json.loads(pool.index.path.read_text())
    del raw["entries"][digest]["sealed"]
    pool.index.path.write_text(json.dumps(raw))
    assert _sealed(pool, digest) is None
    assert check_unless_sealed(pool, digest)[1] is None
    assert _sealed(pool, digest) == file_key(pool.data_path(pool.find(digest)))


def test_an_entry_another_run_removes_while_this_one_reads_it_is_said_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # two runs start at once on an entry written over: the other one removes it first
    from spswap.pool import verify

    pool, digest = _imported(tmp_path)
    _write_over(pool, digest)
    os.utime(pool.data_path(pool.find(digest)), ns=(0, 1))

    def read_and_lose(p: Pool, ref: str) -> object:
        p.remove(ref, force=True)  # (the other run)
        raise PoolEntryNotFound(ref)

    monkeypatch.setattr(verify, "remove_if_damaged", read_and_lose)
    _, problem = check_unless_sealed(pool, digest)
    assert problem == (f"pool entry m ({digest[:12]}) was found damaged by another run at the "
                       f"same time; {REMOVED_FIX}")  # fmt: skip
