"""The freeze holds' names and which of them spswapd's sweeps take: a hold made without a
tag (a test's or a script's dump, no spswapd's root) was left behind empty by a test run
and no sweep ever took it; one of a running daemon's own tag, left empty by a release
whose tree was still leaving, stayed until a daemon of that root started again. No real
cgroups here: the sweep runs on a stand-in hierarchy (a mountinfo naming a plain
directory as cgroup2; the real ones: tests/daemon/test_sweeper_holds.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from spswap.checkpoint import cgroups
from spswap.checkpoint.freeze_hold import (
    EMPTY_STALE_S,
    hold_name,
    hold_of,
    sweep_empty_holds,
    sweepable,
)

TAG = cgroups.root_tag(Path("/dev/shm/spswap"))


def test_hold_names() -> None:
    assert hold_name(TAG, "0123abcd") == f"spswap-parked-{TAG}-hold-0123abcd"
    assert hold_name("", "0123abcd") == "spswap-parked-hold-0123abcd"


@pytest.mark.parametrize(("name", "untagged"), [
    ("spswap-parked-hold-0123abcd", True),
    (f"spswap-parked-{TAG}-hold-0123abcd", False),  # its root's spswapd sweeps it
    ("spswap-parked-doctor-hold-0123abcd", False),
    (f"spswap-parked-{TAG}-7-4242", False),  # a parked cgroup
    ("spswap-parked-probe-hold-4242", False),  # doctor's probe, removed at once
    ("spswap-parked-hold-0123abcd/tree", False),
    ("spswap-parked-hold-0123abc", False),
    ("spswap-parked-hold-0123abcde", False),
    ("spswap-parked-hold-0123ABCD", False),
    ("other-parked-hold-0123abcd", False),  # not spswap's
    ("spswap-parked-hold-", False),
])  # fmt: skip
def test_hold_of_a_tag(name: str, untagged: bool) -> None:
    assert hold_of(name, "") is untagged
    assert hold_of(name, TAG) is (name == f"spswap-parked-{TAG}-hold-0123abcd")


@pytest.mark.parametrize(("name", "age_s", "pids", "taken"), [
    ("spswap-parked-hold-0123abcd", EMPTY_STALE_S + 1, 0, True),
    ("spswap-parked-hold-0123abcd", 0.5, 0, False),  # being made right now
    ("spswap-parked-hold-0123abcd", 3600.0, 1, False),  # a process in it: never
    (f"spswap-parked-{TAG}-hold-0123abcd", 3600.0, 0, False),  # not a sweep of untagged
])  # fmt: skip
def test_sweepable(name: str, age_s: float, pids: int, taken: bool) -> None:
    assert sweepable(name, age_s, pids) is taken
    # the same rows for a sweep of TAG: only its own tag's, on the same terms
    tagged = name.replace("spswap-parked-hold-", f"spswap-parked-{TAG}-hold-")
    assert sweepable(tagged, age_s, pids, TAG) is (taken or (tagged == name and pids == 0))


def test_sweeps_take_only_old_empty_holds_of_their_tag(tmp_path: Path) -> None:
    proc, hierarchy = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    hierarchy.mkdir()
    (proc / "self" / "mountinfo").write_text(
        f"36 25 0:31 / {hierarchy} rw,nosuid,nodev,noexec - cgroup2 cgroup2 rw,nsdelegate\n"
    )
    (proc / "self" / "cgroup").write_text("0::/\n")
    old_s = time.time() - 2 * EMPTY_STALE_S

    def hold(name: str, *, made_s: float, pids: str = "", under: str = "") -> Path:
        top = hierarchy / under / name
        (top / "tree").mkdir(parents=True)
        if pids:
            (top / "tree" / "cgroup.procs").write_text(pids)
        os.utime(top, (made_s, made_s))
        return top

    left = hold("spswap-parked-hold-0123abcd", made_s=old_s)
    new = hold("spswap-parked-hold-89abcdef", made_s=time.time())
    busy = hold("spswap-parked-hold-deadbeef", made_s=old_s, pids="4242\n")
    tagged = hold(f"spswap-parked-{TAG}-hold-00112233", made_s=old_s)
    mine_new = hold(f"spswap-parked-{TAG}-hold-44556677", made_s=time.time())
    # a parked tree's hold is made inside its parked cgroup
    parked = f"spswap-parked-{TAG}-7-4242"
    in_parked = hold(f"spswap-parked-{TAG}-hold-8899aabb", made_s=old_s, under=parked)
    assert sweep_empty_holds("", proc) == [str(left)]
    assert not left.exists()
    assert new.exists() and busy.exists() and tagged.exists()
    assert sweep_empty_holds("", tmp_path / "no-proc") == []  # no mountinfo: nothing
    # a running spswapd's periodic sweep: its own tag's empty holds, made a while ago (a
    # release whose tree was still leaving after its wait left it: CI, 2026-12-07)
    assert sorted(sweep_empty_holds(TAG, proc)) == sorted([str(tagged), str(in_parked)])
    assert not tagged.exists() and not in_parked.exists()
    assert mine_new.exists() and new.exists() and busy.exists()
    assert (hierarchy / parked).exists()  # the parked cgroup itself: not a hold
