"""The pure eviction plan (spswap.pool.capacity) and the layout helpers, without a pool."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spswap.errors import PoolFull
from spswap.liveness import Holder
from spswap.pool import layout
from spswap.pool.capacity import EntryInfo, plan_eviction
from spswap.pool.index import EntryRecord, IndexState, Reservation
from spswap.pool.manifest import Manifest

HOLDER = Holder(pid=1, pid_start=None, uid=0, job_id="7")


def _info(name: str, size_bytes: int, last_used: float) -> EntryInfo:
    m = Manifest(name=name, digest=name * 8, data_size_bytes=size_bytes, tensors=())
    return EntryInfo(manifest=m, path=Path("/p") / m.digest, size_bytes=size_bytes,
                     last_used=last_used, users=[])  # fmt: skip


def _plan(infos: list[EntryInfo], state: IndexState, size: int, *, capacity: int = 100,
          fs_free: int = 1000, exclude: str | None = None) -> list[str]:  # fmt: skip
    got = plan_eviction(infos, state, size, capacity_bytes=capacity, fs_free_bytes=fs_free,
                        exclude=exclude)  # fmt: skip
    return [e.manifest.name for e in got]


def test_nothing_evicted_while_it_fits() -> None:
    assert _plan([_info("a", 30, 1.0), _info("b", 30, 2.0)], IndexState(), 40) == []


def test_oldest_first_and_no_more_than_needed() -> None:
    infos = [_info("new", 30, 3.0), _info("old", 30, 1.0), _info("mid", 30, 2.0)]
    assert _plan(infos, IndexState(), 40) == ["old"]
    assert _plan(infos, IndexState(), 70) == ["old", "mid"]


def test_entries_in_use_are_skipped() -> None:
    infos = [_info("old", 30, 1.0), _info("mid", 30, 2.0)]
    state = IndexState(entries={"old" * 8: EntryRecord(1.0, [HOLDER])})
    assert _plan(infos, state, 70) == ["mid"]


def test_reservations_count_except_the_callers_own() -> None:
    infos = [_info("old", 30, 1.0)]
    state = IndexState(reservations={".tmp-x": Reservation(50, HOLDER)})
    assert _plan(infos, state, 40) == ["old"]
    assert _plan(infos, state, 40, exclude=".tmp-x") == []


def test_file_system_space_counts_too() -> None:
    assert _plan([_info("old", 30, 1.0)], IndexState(), 20, fs_free=10) == ["old"]


def test_full_names_the_users_and_evicts_nothing() -> None:
    infos = [_info("old", 60, 1.0)]
    state = IndexState(entries={"old" * 8: EntryRecord(1.0, [HOLDER])})
    with pytest.raises(PoolFull, match="In use: old .* used by .*job 7") as e:
        _plan(infos, state, 50)
    assert e.value.needed_bytes == 50


def test_tmp_dir_names_tell_whether_their_builder_lives() -> None:
    name = layout.tmp_dir_name(Holder.current())
    assert name.startswith(layout.TMP_PREFIX) and not layout.is_entry_dir_name(name)
    assert layout.tmp_dir_owner_alive(name)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert not layout.tmp_dir_owner_alive(f"{layout.TMP_PREFIX}{dead.stdout.strip()}-1-abc")
    assert not layout.tmp_dir_owner_alive(f"{layout.TMP_PREFIX}garbage")


def test_remove_stale_tmp_dirs_keeps_live_ones_and_entries(tmp_path: Path) -> None:
    live = layout.tmp_dir_name(Holder.current())
    stale = f"{layout.TMP_PREFIX}999999999-1-abc"
    for n in (live, stale, "d" * 64):
        (tmp_path / n).mkdir()
    assert layout.remove_stale_tmp_dirs(tmp_path) == [stale]
    assert sorted(os.listdir(tmp_path)) == sorted([live, "d" * 64])
    assert layout.remove_stale_tmp_dirs(tmp_path / "missing") == []
