"""The pure eviction plan (spswap.pool.capacity) and the layout helpers, without a pool."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spswap.errors import PoolFull, RequestRefused
from spswap.liveness import Holder
from spswap.pool import layout
from spswap.pool.capacity import EntryInfo, UserShare, plan_eviction, user_charge_bytes
from spswap.pool.index import (
    MAX_USES_PER_USER,
    EntryRecord,
    IndexState,
    Reservation,
    check_uses_left,
)
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
    return [e.manifest.name for e in got.evict]


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


# -- one user's share (SPSWAP_POOL_USER_BYTES) ------------------------------------------

USER = 1000


def _share(infos: list[EntryInfo], state: IndexState, size: int, budget: int, *,
           capacity: int = 1000) -> tuple[list[str], list[str]]:  # fmt: skip
    got = plan_eviction(infos, state, size, capacity_bytes=capacity, fs_free_bytes=10_000,
                        exclude=".tmp-mine", user=UserShare(USER, budget))  # fmt: skip
    return [e.manifest.name for e in got.evict], got.release


def _owned(**importers: list[int]) -> IndexState:
    return IndexState(entries={n * 8: EntryRecord(1.0, [], uids) for n, uids in importers.items()})


def test_a_share_makes_room_from_its_own_oldest_entries_only() -> None:
    infos = [_info("root", 30, 0.5), _info("other", 30, 1.0), _info("mine1", 30, 2.0),
             _info("mine2", 30, 3.0)]  # fmt: skip
    state = _owned(root=[], other=[2000], mine1=[USER], mine2=[USER])
    # the pool has room (capacity 1000): only the share is full
    assert _share(infos, state, 30, 70) == (["mine1"], [])
    assert _share(infos, state, 30, 40) == (["mine1", "mine2"], [])
    assert _share(infos, state, 30, 100) == ([], [])


def test_an_entry_another_user_imported_too_stops_counting_instead_of_going() -> None:
    infos = [_info("both", 30, 1.0), _info("mine", 30, 2.0)]
    state = _owned(both=[USER, 2000], mine=[USER])
    assert _share(infos, state, 30, 70) == ([], ["both" * 8])


def test_a_full_share_is_refused_and_names_what_keeps_it_full() -> None:
    infos = [_info("mine1", 30, 1.0), _info("mine2", 30, 2.0), _info("other", 30, 0.5)]
    state = _owned(mine1=[USER], mine2=[USER], other=[2000])
    state.entries["mine1" * 8].uses.append(HOLDER)
    state.reservations[".tmp-other-build"] = Reservation(20, HOLDER, USER)
    state.reservations[".tmp-mine"] = Reservation(30, HOLDER, USER)  # the caller's own
    with pytest.raises(PoolFull) as e:
        _share(infos, state, 30, 70)  # mine2 would make room for 20 of the 30
    msg = str(e.value)
    assert msg.startswith(f"your share of the pool is full: uid {USER}'s imports hold 80 B of "
                          "SPSWAP_POOL_USER_BYTES=70 B, and this import of 30 B would take it "
                          "40 B over (your entries in use: mine1 (mine1mine1mi, 30 B) used "
                          "by ")  # fmt: skip
    assert "used by" in msg and "job 7" in msg and "your imports under way: 20 B" in msg
    assert msg.endswith("wait for your jobs that use them to end, or ask the node's admin to "
                        "raise SPSWAP_POOL_USER_BYTES")  # fmt: skip
    # an entry spswapd holds for a job's checkpoint image: what lets it go
    image = Holder(pid=9, pid_start=None, uid=0, purpose="image", for_job="1086")
    state.entries["mine1" * 8].uses[:] = [image]
    with pytest.raises(PoolFull) as e:
        _share(infos, state, 30, 70)
    assert "mine1 (mine1mine1mi, 30 B) used by spswapd, for job 1086's checkpoint image" in \
        str(e.value)  # fmt: skip
    assert (
        "(one held for a job's checkpoint image is let go when that job runs again, or "
        "when you cancel it: scancel JOB)"
    ) in str(e.value)
    assert e.value.free_bytes == 0 and e.value.needed_bytes == 30
    with pytest.raises(PoolFull) as e:
        _share([], IndexState(), 90, 80)
    assert str(e.value) == (
        f"your share of the pool cannot hold it: it needs 90 B, more than all of "
        f"SPSWAP_POOL_USER_BYTES=80 B (uid {USER}); ask the node's admin to raise "
        "SPSWAP_POOL_USER_BYTES, or use a smaller model"
    )  # waiting would not help: it does not say to wait


def test_no_more_goes_than_the_new_entry_needs() -> None:
    """Oldest first, but an older entry that the newer ones' going made unneeded stays
    (a newcomer's 10 MiB entry went with the 80 MiB one that alone made room)."""
    infos = [_info("tiny", 10, 1.0), _info("small", 80, 2.0)]
    state = _owned(tiny=[USER], small=[USER])
    assert _share(infos, state, 80, 100) == (["small"], [])
    got = plan_eviction(infos, IndexState(), 80, capacity_bytes=100, fs_free_bytes=10_000,
                        exclude=None)  # fmt: skip
    assert [e.manifest.name for e in got.evict] == ["small"] and got.for_share == frozenset()
    got = plan_eviction(infos, state, 80, capacity_bytes=1000, fs_free_bytes=10_000,
                        exclude=None, user=UserShare(USER, 100))  # fmt: skip
    assert got.for_share == {"small" * 8}


def test_after_its_share_the_pool_still_makes_room_from_anyones_oldest() -> None:
    infos = [_info("other", 30, 1.0), _info("mine", 30, 2.0)]
    state = _owned(other=[2000], mine=[USER])
    # share fits (60 of 100) but the pool (capacity 70) does not: the oldest unused goes
    assert _share(infos, state, 30, 100, capacity=70) == (["other"], [])
    # a share's own eviction counts for the pool too: no second entry goes
    assert _share(infos, state, 30, 40, capacity=70) == (["mine"], [])


def test_user_charge_counts_entries_and_builds_but_the_callers_own() -> None:
    infos = [_info("mine", 30, 1.0), _info("other", 50, 1.0)]
    state = _owned(mine=[USER], other=[2000])
    state.reservations[".tmp-a"] = Reservation(7, HOLDER, USER)
    state.reservations[".tmp-b"] = Reservation(9, HOLDER, None)
    assert user_charge_bytes(infos, state, USER) == 37
    assert user_charge_bytes(infos, state, USER, exclude=".tmp-a") == 30
    assert user_charge_bytes(infos, state, 2000) == 50


def test_uses_are_bounded_per_user_not_for_root() -> None:
    user = Holder(pid=5, pid_start=None, uid=USER, job_id=None)
    root = Holder(pid=6, pid_start=None, uid=0, job_id=None)
    state = IndexState(entries={"a" * 64: EntryRecord(1.0, [user] * (MAX_USES_PER_USER - 1))})
    check_uses_left(state, user)  # one left
    state.entries["a" * 64].uses.append(user)
    with pytest.raises(RequestRefused, match=f"uid {USER}\\) hold {MAX_USES_PER_USER} uses"):
        check_uses_left(state, user)
    state.entries["b" * 64] = EntryRecord(1.0, [root] * (MAX_USES_PER_USER + 5))
    check_uses_left(state, root)


def test_another_users_use_does_not_lock_a_share() -> None:
    """An entry of the user's that only another user's processes use stays (it is in
    use) but moves off the user's share: else anyone could pin a user's entries with
    pool.use and refuse all their imports. Root's uses (spswapd's for an image) keep it."""
    other = Holder(pid=3, pid_start=None, uid=2000, job_id=None)
    infos = [_info("mine", 30, 1.0), _info("newer", 30, 2.0)]
    state = _owned(mine=[USER], newer=[USER])
    state.entries["mine" * 8].uses.append(other)
    assert _share(infos, state, 30, 70) == ([], ["mine" * 8])
    state.entries["mine" * 8].uses.append(HOLDER)  # root's use too: it keeps it
    assert _share(infos, state, 30, 70) == (["newer"], [])
