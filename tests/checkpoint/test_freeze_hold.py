"""The hold a tree waits in, frozen, from its last credential check to CRIU's seize:
the tree does not run there, its user cannot thaw it, and it goes back home after."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spswap.checkpoint import freeze_hold
from spswap.checkpoint.cgroups import memberships
from tests.uids import as_user

from .test_criu_as_user import _count, _counts_on, user_counter  # noqa: F401 - the fixture

pytestmark = pytest.mark.skipif(not freeze_hold.probe()[0], reason=freeze_hold.probe()[1])


def _thaw_as_user(path: str) -> str:
    try:
        with open(path, "w") as f:
            f.write("0")
        return "written"
    except OSError as e:
        return type(e).__name__


def _v2(pid: int) -> str:
    return next(m.path for m in memberships(pid) if m.controllers == "")


@pytest.fixture
def hold(user_counter: tuple[int, Path]) -> Iterator[freeze_hold.FreezeHold]:  # noqa: F811
    pid, _ = user_counter
    h = freeze_hold.FreezeHold.create(pid, "test")
    assert h is not None
    yield h
    h.release()


def test_the_tree_is_frozen_and_its_user_cannot_thaw_it(
    user_counter: tuple[int, Path],  # noqa: F811
    hold: freeze_hold.FreezeHold,
    user_uid: int,  # noqa: F811
) -> None:
    pid, count = user_counter
    home = hold.homes[pid]
    assert hold.pids() == {pid}
    assert _v2(pid).endswith("/tree") and os.stat(hold.top).st_mode & 0o777 == 0o700
    frozen_at = _count(count)
    time.sleep(0.2)
    assert _count(count) == frozen_at, "the held tree ran"
    # even with the freeze file given to the user for CRIU's run, the path is barred
    arg, fds = hold.for_criu((user_uid, -1))
    assert arg == f"/proc/self/fd/{fds[0]}"
    assert as_user(user_uid, _thaw_as_user, str(hold.tree / "cgroup.freeze")) == "PermissionError"
    assert _count(count) == frozen_at
    assert hold.release() == []
    assert _counts_on(count, frozen_at), "released, it runs again"
    assert not hold.top.exists(), "the hold's cgroups are removed"
    assert (home / "cgroup.procs").read_text().split().count(str(pid)) == 1


def test_a_hold_a_dead_spswapd_left_is_swept(user_counter: tuple[int, Path]) -> None:  # noqa: F811
    """spswapd's start-up sweep ends what a dead one left frozen in a hold of its root."""
    from spswap.checkpoint import cgroups

    pid, _ = user_counter
    h = freeze_hold.FreezeHold.create(pid, "sweeptag")
    assert h is not None and h.top.name.startswith(f"{cgroups.PREFIX}sweeptag-hold-")
    assert str(h.top) in cgroups.sweep("sweeptag")
    assert not h.top.exists()
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the held process was not ended"
        time.sleep(0.01)


def test_a_hold_inside_a_frozen_parked_cgroup_is_released_at_once(
    user_counter: tuple[int, Path],  # noqa: F811
) -> None:
    """A kept tree's hold is made in its parked cgroup, which CRIU's post-dump step
    freezes before it lets the tree go: the empty hold then stays "frozen 1" whatever
    it is told, and a release that waited for its thaw ran out its whole wait (10 s of
    every kept dump on the H200)."""
    from spswap.checkpoint import cgroups

    pid, _ = user_counter
    own = cgroups.own_dirs(cgroups.mounts()).get("")
    assert own is not None
    parked = own / f"{cgroups.PREFIX}heldtest"
    parked.mkdir()
    try:
        (parked / "cgroup.procs").write_text(str(pid))
        h = freeze_hold.FreezeHold.create(pid, "heldtest")
        assert h is not None and h.top.parent == parked, "the hold is made in the parked cgroup"
        (parked / "cgroup.freeze").write_text("1")  # as CRIU's post-dump writes do
        t0 = time.monotonic()
        assert h.release() == []
        assert time.monotonic() - t0 < freeze_hold.FREEZE_WAIT_S / 2, "the release waited"
        assert not h.top.exists()
        assert (parked / "cgroup.procs").read_text().split() == [str(pid)]
        assert "frozen 1" in (parked / "cgroup.events").read_text().split("\n"), "it stays frozen"
    finally:
        (parked / "cgroup.freeze").write_text("0")
        (own / "cgroup.procs").write_text(str(pid))
        freeze_hold._rmdir(parked, wait_s=2)
