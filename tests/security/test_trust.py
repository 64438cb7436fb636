"""Root trusts neither a state tree another user prepared nor a socket another user serves."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path

import pytest

from spswap.config import Config
from spswap.daemon import lifecycle
from spswap.daemon.client import Client
from spswap.daemon.trust import unsafe_dir
from spswap.errors import DaemonError, PermissionDenied
from tests.uids import spawn_as


def test_unsafe_dir_reasons(tmp_path: Path) -> None:
    assert unsafe_dir(tmp_path / "absent") is None
    ok = tmp_path / "ok"
    ok.mkdir(mode=0o755)
    os.chmod(ok, 0o755)
    assert unsafe_dir(ok, uid=os.getuid()) is None
    os.chmod(ok, 0o777)
    assert "writable by group or others" in (unsafe_dir(ok, uid=os.getuid()) or "")
    link = tmp_path / "link"
    link.symlink_to(ok)
    assert "symbolic link" in (unsafe_dir(link, uid=os.getuid()) or "")
    assert "owned by uid" in (unsafe_dir(ok, uid=os.getuid() + 1) or "")


def test_root_refuses_a_tree_another_user_prepared(user_uid: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="sptr-", dir="/tmp"))
    os.chmod(root, 0o755)
    try:
        run = root / "run"
        run.mkdir()
        os.chown(run, user_uid, -1)  # the user got there first
        cfg = Config.from_env({}, root=root)
        with pytest.raises(PermissionDenied, match=rf"owned by uid {user_uid}.*rm -rf"):
            lifecycle.prepare_dirs(cfg)
        with pytest.raises(PermissionDenied):
            lifecycle.start(cfg, wait_s=5)
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def _fake_daemon(path: str) -> str:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path + ".new")  # listening before the test sees the file
    s.listen(1)
    os.rename(path + ".new", path)
    s.settimeout(10)
    try:
        conn, _ = s.accept()
        conn.settimeout(2)
        got = conn.recv(100)
        return "received" if got else "nothing"
    except OSError:
        return "nothing"


def test_client_sends_nothing_to_a_daemon_of_another_uid(user_uid: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="sptr-", dir="/tmp"))
    os.chmod(root, 0o777)
    cfg = Config.from_env({}, root=root)
    cfg.paths.run.mkdir()
    os.chmod(cfg.paths.run, 0o777)
    child = spawn_as(user_uid, _fake_daemon, str(cfg.paths.socket))
    deadline = time.monotonic() + 10
    while not cfg.paths.socket.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(DaemonError, match=rf"runs as uid {user_uid}, not root"):
        Client(cfg, timeout_s=5).call("ping")
    assert child.result() == "nothing"


def test_a_root_directory_a_user_made_is_moved_aside(user_uid: int) -> None:
    """On /dev/shm anyone can create the root first: that must not keep spswapd down."""
    import shutil

    parent = Path(tempfile.mkdtemp(prefix="sptq-", dir="/tmp"))
    os.chmod(parent, 0o1777)
    root = parent / "spswap"
    root.mkdir()
    os.chown(root, user_uid, -1)
    (root / "planted").write_text("x")
    cfg = Config.from_env({}, root=root)
    try:
        lifecycle.start(cfg, wait_s=15)
        assert os.stat(root).st_uid == 0 and not (root / "planted").exists()
        (aside,) = [p for p in parent.iterdir() if p.name.startswith("spswap.untrusted-")]
        assert (aside / "planted").exists()
        kinds = [e["kind"] for e in Client(cfg).call("events.tail", n=10)]
        assert "root.quarantined" in kinds
    finally:
        lifecycle.stop(cfg, timeout_s=5)
        shutil.rmtree(parent, ignore_errors=True)
