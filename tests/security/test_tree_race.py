"""Root never creates, chmods or writes through a path a user controls while it makes its
state tree (issue 19, item 1): a second uid hammers the window between root's check and
its use for thousands of starts, planting symlinks where the root, run/ and log/ go."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spswap.config import Config
from spswap.daemon import lifecycle
from spswap.errors import PermissionDenied
from tests.uids import spawn_as

ITERATIONS = 3000


@pytest.fixture
def parent() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="sptr-", dir="/tmp"))
    os.chmod(d, 0o1777)  # like /dev/shm: anyone may create, only owners rename or remove
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _hammer(parent: str, victim: str, stop: str) -> int:
    """(The attacker) whenever the root is gone, put one there: a prepared tree renamed in
    at once (run, log and images links to root's directory), a link to that directory,
    or a fresh directory that gets the links right after."""
    root, links, n = os.path.join(parent, "spswap"), ("run", "log", "images"), 0
    while not os.path.exists(stop):
        n += 1
        how = n % 3
        try:
            if how == 0:
                stage = os.path.join(parent, f"stage-{n}")
                os.mkdir(stage)
                for name in links:
                    os.symlink(victim, os.path.join(stage, name))
                try:
                    os.rename(stage, root)
                except OSError:
                    shutil.rmtree(stage, ignore_errors=True)
            elif how == 1:
                os.symlink(victim, root)
            else:
                os.mkdir(root)
                for name in links:
                    os.symlink(victim, os.path.join(root, name))
        except OSError:
            pass
    return n


def _clear(parent: Path) -> int:
    """Root's side between starts: remove the tree and whatever was moved aside (how many
    of the user's roots were)."""
    moved = 0
    for p in parent.iterdir():
        moved += p.name.startswith("spswap.untrusted-")
        if p.name == "spswap" or p.name.startswith("spswap.untrusted-"):
            if p.is_symlink() or not p.is_dir():
                p.unlink()
            else:
                shutil.rmtree(p)
    return moved


def test_root_never_follows_a_users_links_while_it_makes_its_tree(
    parent: Path, user_uid: int
) -> None:
    victim = Path(tempfile.mkdtemp(prefix="sptv-", dir="/tmp"))  # root's, private
    os.chmod(victim, 0o700)
    stop = parent / "stop"
    cfg = Config.from_env({}, root=parent / "spswap")
    child = spawn_as(user_uid, _hammer, str(parent), str(victim), str(stop))
    refused: list[str] = []
    moved = 0
    try:
        for i in range(ITERATIONS):
            if i % 4 == 0:  # let the attacker settle in now and then; the rest race her
                time.sleep(0.001)
            try:
                lifecycle.prepare_dirs(cfg)
            except PermissionDenied as e:
                refused.append(str(e))
            for d in (cfg.root, cfg.paths.run, cfg.paths.log):
                st = os.lstat(d)
                assert stat.S_ISDIR(st.st_mode) and st.st_uid == 0, (d, st)
            moved += _clear(parent)
    finally:
        stop.write_text("")
        tries = child.result()
        st = os.stat(victim)
        entries = os.listdir(victim)
        shutil.rmtree(victim, ignore_errors=True)
    assert stat.S_IMODE(st.st_mode) == 0o700 and entries == [], (oct(st.st_mode), entries)
    # the attacker was in the way often: every one of those starts swapped her tree out
    assert refused == [] and tries > ITERATIONS and moved > ITERATIONS // 5, (tries, moved)


def _own_pid_file(root: str, pid: int) -> None:
    """(The attacker) a root of her own whose pid file names someone else's process, held
    locked (as a running daemon's is)."""
    import fcntl

    os.makedirs(os.path.join(root, "run"))
    fd = os.open(os.path.join(root, "run", "spswapd.pid"), os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, f"{pid}\n".encode())
    fcntl.flock(fd, fcntl.LOCK_EX)
    time.sleep(10)  # killed by the test


def test_root_signals_no_pid_a_user_wrote(parent: Path, user_uid: int) -> None:
    """`spswap daemon stop` (root) on a root a user made must not kill the pid in it."""
    bystander = subprocess.Popen(["sleep", "60"])
    root = parent / "spswap"
    child = spawn_as(user_uid, _own_pid_file, str(root), bystander.pid)
    try:
        deadline = time.monotonic() + 10
        while not (root / "run" / "spswapd.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # its lock is taken right after the write
        cfg = Config.from_env({}, root=root)
        assert lifecycle.daemon_running(cfg) is None
        assert lifecycle.stop(cfg, timeout_s=1) is None
        assert bystander.poll() is None
    finally:
        os.kill(child.pid, signal.SIGKILL)
        os.waitpid(child.pid, 0)
        os.close(child.rfd)
        bystander.kill()
        bystander.wait()


def _swap_in_links(parent: str, victim: str, stop: str) -> int:
    """(The attacker, owner of the parent) rename whatever root made aside and put a tree
    of links in its place, over and over."""
    root, n = os.path.join(parent, "spswap"), 0
    while not os.path.exists(stop):
        n += 1
        try:
            os.rename(root, os.path.join(parent, f"gone-{n}"))
        except OSError:
            pass
        try:
            stage = os.path.join(parent, f"stage-{n}")
            os.mkdir(stage)
            for name in ("run", "log"):
                os.symlink(victim, os.path.join(stage, name))
            os.rename(stage, root)
        except OSError:
            pass
    return n


def test_a_parent_a_user_owns_is_refused(user_uid: int) -> None:
    """In a directory a user owns she can rename root's tree away at any moment, after
    every check: root refuses to make its tree there at all."""
    parent = Path(tempfile.mkdtemp(prefix="sptp-", dir="/tmp"))
    os.chmod(parent, 0o755)
    os.chown(parent, user_uid, -1)
    victim = Path(tempfile.mkdtemp(prefix="sptv-", dir="/tmp"))
    os.chmod(victim, 0o700)
    stop = Path(tempfile.mkdtemp(prefix="sptp-", dir="/tmp")) / "stop"
    os.chmod(stop.parent, 0o755)  # the attacker must see it appear
    cfg = Config.from_env({}, root=parent / "spswap")
    child = spawn_as(user_uid, _swap_in_links, str(parent), str(victim), str(stop))
    refused = 0
    try:
        for _ in range(300):
            try:
                lifecycle.prepare_dirs(cfg)
            except PermissionDenied as e:
                assert f"{parent} is owned by uid {user_uid}" in str(e), e
                refused += 1
    finally:
        stop.write_text("")
        child.result()
        st = os.stat(victim)
        entries = os.listdir(victim)
        for d in (parent, victim, stop.parent):
            shutil.rmtree(d, ignore_errors=True)
    assert refused == 300
    assert stat.S_IMODE(st.st_mode) == 0o700 and entries == [], (oct(st.st_mode), entries)


def _plant_tree(root: str, victim: str) -> None:
    """(The attacker, first on the node) a root whose pool/ and slots/ lead to root's files."""
    os.mkdir(root)
    for name in ("pool", "slots", "run"):
        os.symlink(victim, os.path.join(root, name))


def test_roots_direct_writes_claim_the_tree_first(parent: Path, user_uid: int) -> None:
    """Root's own `spswap pool import` and slot reservation, with no spswapd started yet
    and a user's tree in the way, move it aside and write into a tree of root's."""
    from spswap import access
    from tests.pool.st_files import tensors, write_st

    victim = Path(tempfile.mkdtemp(prefix="sptv-", dir="/tmp"))
    os.chmod(victim, 0o700)
    root = parent / "spswap"
    spawn_as(user_uid, _plant_tree, str(root), str(victim)).result()
    cfg = Config.from_env({"SPSWAP_GPUS": "0"}, root=root)
    try:
        m = access.import_model(cfg, write_st(parent / "m.safetensors", tensors(31)))
        r = access.reserve_slot(cfg, model="m", units=1, allowed_gpus=[0], timeout_s=5)
        access.release_slot(cfg, r.id)
        assert os.lstat(root).st_uid == 0 and (root / "pool" / m.digest).is_dir()
        assert not (root / "pool").is_symlink() and not (root / "slots").is_symlink()
        assert os.listdir(victim) == [] and stat.S_IMODE(os.stat(victim).st_mode) == 0o700
    finally:
        shutil.rmtree(victim, ignore_errors=True)
