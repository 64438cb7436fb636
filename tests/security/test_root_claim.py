"""Whatever a user plants where the state root goes, ``spswap daemon start`` (root) starts:
a foreign root is moved aside under a name no user can guess or occupy, and a user who
recreates the root in a loop only makes it retry (issue 19, item 3)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spswap.config import Config
from spswap.daemon import lifecycle
from tests.uids import spawn_as

PLANTED = 800


@pytest.fixture
def parent() -> Iterator[Path]:
    """A world-writable, sticky parent (like /dev/shm) that holds the root."""
    d = Path(tempfile.mkdtemp(prefix="sprc-", dir="/tmp"))
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _plant_names(root: str, n: int) -> int:
    """The user's part: a root of their own, and every name the old code would have moved
    it to (``ROOT.untrusted-<time>-<uid>``, the next ``n`` seconds), each non-empty."""
    os.mkdir(root)
    Path(root, "planted").write_text("mine")
    now, uid = int(time.time()), os.getuid()
    for t in range(now - 5, now + n):
        d = Path(f"{root}.untrusted-{t}-{uid}")
        d.mkdir()
        (d / "keep").write_text(str(t))
    return n


def test_start_with_every_predictable_name_planted(parent: Path, user_uid: int) -> None:
    root = parent / "spswap"
    spawn_as(user_uid, _plant_names, str(root), PLANTED).result()
    before = {p.name for p in parent.iterdir()}
    cfg = Config.from_env({}, root=root)
    try:
        lifecycle.start(cfg, wait_s=15)
        st = os.lstat(root)
        assert st.st_uid == 0 and stat.S_ISDIR(st.st_mode) and not (root / "planted").exists()
        after = {p.name for p in parent.iterdir()}
        (aside,) = after - before  # the user's root, under a name of its own
        assert aside.startswith("spswap.untrusted-") and (parent / aside / "planted").exists()
        for name in before - {"spswap"}:  # every planted directory is as it was
            assert len(list((parent / name).iterdir())) == 1, name
    finally:
        lifecycle.stop(cfg, timeout_s=5)


def _recreate_loop(root: str, stop_file: str, seconds: float) -> int:
    """Recreate the root as this user whenever it is gone (as fast as it can)."""
    made = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not os.path.exists(stop_file):
        try:
            os.mkdir(root)
            made += 1
        except OSError:
            pass
    return made


def test_start_while_a_user_recreates_the_root(parent: Path, user_uid: int) -> None:
    root = parent / "spswap"
    stop_file = parent / "stop"
    cfg = Config.from_env({}, root=root)
    child = spawn_as(user_uid, _recreate_loop, str(root), str(stop_file), 120.0)
    starts = 0
    try:
        deadline = time.monotonic() + 90
        while starts < 15 and time.monotonic() < deadline:
            lifecycle.start(cfg, wait_s=15)
            assert os.lstat(root).st_uid == 0
            lifecycle.stop(cfg, timeout_s=5)
            shutil.rmtree(root)  # gone: the user's loop makes it again at once
            starts += 1
            if starts % 2:  # every other start surely finds the user's root, the rest race
                time.sleep(0.02)
    finally:
        stop_file.write_text("")
        made = child.result()
        lifecycle.stop(cfg, timeout_s=5)
    # every root the user made but the last was in the way of a start, and moved aside
    asides = [p for p in parent.iterdir() if p.name.startswith("spswap.untrusted-")]
    assert starts == 15 and made >= 7 and made - 1 <= len(asides) <= made, (starts, made)


def _plant_link(root: str, target: str) -> None:
    os.symlink(target, root)


@pytest.mark.parametrize("exchange", [True, False])
def test_claim_moves_a_users_link_aside(
    parent: Path, user_uid: int, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    """A symlink is moved, never followed; without RENAME_EXCHANGE (some file systems) a
    rename that replaces nothing does the same."""
    import errno

    from spswap.daemon import tree

    if not exchange:
        real = tree.renameat2

        def no_exchange(a: int, b: str, c: int, d: str, flags: int) -> None:
            if flags == tree.RENAME_EXCHANGE:
                raise OSError(errno.EINVAL, "no exchange here")
            real(a, b, c, d, flags)

        monkeypatch.setattr(tree, "renameat2", no_exchange)
    target = parent / "target"
    target.mkdir(mode=0o700)
    spawn_as(user_uid, _plant_link, str(parent / "spswap"), str(target)).result()
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        rfd, aside, made = tree.claim_root(fd, "spswap")
        os.close(rfd)
    finally:
        os.close(fd)
    assert made and aside is not None and os.readlink(parent / aside) == str(target)
    st = os.lstat(parent / "spswap")
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == 0
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o700 and not list(target.iterdir())
