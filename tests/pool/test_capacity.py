"""Capacity, LRU eviction, and entries held by live (real, separate) processes."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from spswap.errors import PoolEntryInUse, PoolFull
from spswap.liveness import Holder
from spswap.pool.manifest import Manifest
from spswap.pool.store import Pool

from .st_files import pool_snapshot, spawn_python, tensors, write_st

HOLD = """
import sys, time
from pathlib import Path
from spswap.pool.store import Pool
m = Pool(Path(sys.argv[1])).acquire_use(sys.argv[2])
print(m.digest, flush=True)
time.sleep(120)
"""


def _import(pool: Pool, tmp_path: Path, seed: int) -> Manifest:
    return pool.import_checkpoint(write_st(tmp_path / f"m{seed}.safetensors", tensors(seed)),
                                  name=f"m{seed}")  # fmt: skip


@pytest.fixture
def sized(tmp_path: Path) -> tuple[Pool, int]:
    """A pool whose capacity holds exactly three of our test entries."""
    probe = Pool(tmp_path / "probe")
    _import(probe, tmp_path, 99)
    entry_bytes = probe.entries()[0].size_bytes
    return Pool(tmp_path / "pool", capacity_bytes=3 * entry_bytes + entry_bytes // 2), entry_bytes


def test_lru_eviction_order(sized: tuple[Pool, int], tmp_path: Path) -> None:
    pool, _ = sized
    m1, m2, m3 = (_import(pool, tmp_path, s) for s in (1, 2, 3))
    with pool.use(m1.digest):  # m1 becomes the most recently used
        pass
    m4 = _import(pool, tmp_path, 4)  # evicts m2 (oldest use)
    assert {e.manifest.name for e in pool.entries()} == {"m1", "m3", "m4"}
    m5 = _import(pool, tmp_path, 5)  # then m3
    assert [e.manifest.digest for e in pool.entries()] == [m5.digest, m4.digest, m1.digest]
    assert not pool.entry_dir(m2.digest).exists() and not pool.entry_dir(m3.digest).exists()
    assert pool.used_bytes <= pool.capacity_bytes


def test_entry_used_here_is_not_evicted(sized: tuple[Pool, int], tmp_path: Path) -> None:
    pool, _ = sized
    m1 = _import(pool, tmp_path, 1)
    with pool.use("m1"):
        for seed in (2, 3, 4):
            _import(pool, tmp_path, seed)
        assert pool.find("m1") == m1
        assert "m2" not in {e.manifest.name for e in pool.entries()}


def test_live_process_pins_entry_until_killed(sized: tuple[Pool, int], tmp_path: Path) -> None:
    pool, entry_bytes = sized
    ms = [_import(pool, tmp_path, s) for s in (1, 2, 3)]
    holders = [spawn_python(HOLD, str(pool.pool_dir), m.digest[:10]) for m in ms]
    try:
        for h, m in zip(holders, ms, strict=True):
            assert h.stdout is not None and h.stdout.readline().strip() == m.digest
        users = {e.manifest.name: [u.pid for u in e.users] for e in pool.entries()}
        assert users == {f"m{i + 1}": [h.pid] for i, h in enumerate(holders)}
        before = pool_snapshot(pool.pool_dir)
        with pytest.raises(PoolFull) as e:
            _import(pool, tmp_path, 4)
        msg = str(e.value)
        assert f"pid {holders[0].pid}" in msg and "spswap pool rm" in msg
        assert "SPSWAP_POOL_CAPACITY_BYTES" in msg
        assert e.value.needed_bytes > e.value.free_bytes
        assert pool_snapshot(pool.pool_dir) == before  # nothing evicted, no temp dir left
        with pytest.raises(PoolEntryInUse, match=f"pid {holders[1].pid}"):
            pool.remove("m2")
        holders[1].send_signal(signal.SIGKILL)
        holders[1].wait()
        m4 = _import(pool, tmp_path, 4)  # the dead holder's entry goes
        assert {e.manifest.name for e in pool.entries()} == {"m1", "m3", "m4"}
        assert pool.find("m4") == m4
    finally:
        for h in holders:
            h.kill()
            h.wait()


def test_ensure_room_larger_than_capacity(sized: tuple[Pool, int]) -> None:
    pool, _ = sized
    with pytest.raises(PoolFull, match="need"):
        pool.ensure_room(pool.capacity_bytes + 1)


def test_job_bound_user_lives_with_its_job(sized: tuple[Pool, int], tmp_path: Path) -> None:
    pool, _ = sized
    m1 = _import(pool, tmp_path, 1)
    jobs = {"42": True}
    pool = Pool(pool.pool_dir, capacity_bytes=pool.capacity_bytes, job_alive=jobs.get)
    dead_pid = Holder(pid=999_999_999, pid_start=1, uid=0, job_id="42", since=time.time())
    pool.acquire_use(m1.digest, dead_pid)
    assert [u.job_id for u in pool.entries()[0].users] == ["42"]
    jobs["42"] = False
    assert pool.entries()[0].users == []
    pool.remove("m1")


def test_remove_force_and_release(sized: tuple[Pool, int], tmp_path: Path) -> None:
    pool, _ = sized
    m1 = _import(pool, tmp_path, 1)
    me = Holder.current()
    pool.acquire_use("m1", me)
    with pytest.raises(PoolEntryInUse):
        pool.remove("m1")
    pool.release_use(m1.digest, me)
    assert pool.entries()[0].users == []
    pool.acquire_use("m1", me)
    assert pool.remove("m1", force=True) == m1
    assert pool.entries() == []


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)],
                         capture_output=True, text=True)  # fmt: skip
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_build_that_outgrew_its_reservation_needs_room_only_for_the_difference(
    small_tmpfs: Path,
) -> None:
    """Its manifest (a name per tensor) took it past its reservation: room is made for
    what it holds beyond it, not for all of it again (its data is on the file system
    already: the whole size again made a 320 KiB entry on a 512 KiB tmpfs PoolFull)."""
    pool = Pool(small_tmpfs / "pool", capacity_bytes=10 << 20)
    data = np.arange(2048, dtype=np.float32).tobytes()  # 8 KiB: two aligned pages each
    with pool.writer("many", expected_size_bytes=40 * len(data)) as w:
        for i in range(40):
            w.add(f"layers.{i}.weight", "F32", (2048,), data)
    (entry,) = pool.entries()
    assert entry.manifest.name == "many" and entry.size_bytes > 40 * len(data) + 4096
