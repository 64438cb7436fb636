"""The pool through spswapd for a second real uid: imports of only what it can read,
uses held by its own process, and no write to the pool's files."""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spswap import access
from spswap.config import Config
from spswap.daemon import events
from spswap.daemon.client import Client
from spswap.pool.store import Pool
from tests.pool.st_files import tensors, write_sharded, write_st
from tests.security.conftest import TEST_USER, as_user, outcome, spawn_as


def _user_dir(cfg: Config, uid: int) -> Path:
    d = cfg.root / "home"
    d.mkdir(mode=0o700)
    os.chown(d, uid, -1)
    return d


def _chown_tree(path: Path, uid: int, mode: int = 0o600) -> None:
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.chown(p, uid, -1)
        os.chmod(p, 0o700 if p.is_dir() else mode)


def _data(pool: Pool, digest: str) -> dict[str, bytes]:
    m = pool.find(digest)
    raw = pool.data_path(m).read_bytes()
    return {t.name: raw[t.offset : t.offset + t.size_bytes] for t in m.tensors}


def _user_imports(cfg: Config, own: str, sharded: str, root_only: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # a job id the caller does not own (root's job 100) is not written into the event log
    out["own"] = access.import_model(cfg, own, job_id="100").to_json()
    out["own_again"] = access.import_model(cfg, own, job_id="200").digest
    out["sharded"] = access.import_model(cfg, sharded, name="shardy", job_id="200").to_json()
    out["root_only"] = outcome(access.import_model, cfg, root_only)
    # an O_PATH descriptor needs no read permission: the daemon must not accept one
    fd = os.open(root_only, os.O_PATH)
    try:
        out["o_path"] = outcome(Client(cfg).call_with_fds, "pool.import", [fd],
                                files=["model.safetensors"])  # fmt: skip
    finally:
        os.close(fd)
    fd = os.open(own, os.O_RDONLY)
    try:
        out["fd_count"] = outcome(Client(cfg).call_with_fds, "pool.import", [fd],
                                  files=["a.safetensors", "b.safetensors"])  # fmt: skip
        out["fd_on_ping"] = outcome(Client(cfg).call_with_fds, "ping", [fd])
        out["bad_name"] = outcome(Client(cfg).call_with_fds, "pool.import", [fd],
                                  files=["../model.safetensors"])  # fmt: skip
    finally:
        os.close(fd)
    pool = Pool.from_config(cfg)
    out["read_only"] = pool.read_only
    out["listed"] = sorted(e.manifest.name for e in pool.entries())
    out["direct_import"] = outcome(pool.import_checkpoint, Path(own))
    out["direct_use"] = outcome(pool.acquire_use, "shardy")
    out["write_index"] = outcome(open, pool.index.path, "r+")
    out["write_data"] = outcome(open, pool.data_path(pool.find("shardy")), "r+b")
    out["new_file"] = outcome(open, pool.pool_dir / "mine", "w")
    return out


def test_user_imports_what_it_can_read(cfg: Config, daemon: int, user_uid: int) -> None:
    home = _user_dir(cfg, user_uid)
    own = write_st(home / "own.safetensors", tensors(1))
    sharded = write_sharded(home / "sharded", [tensors(2), {"extra": np.arange(9.0)}])
    _chown_tree(own, user_uid)
    _chown_tree(sharded, user_uid)
    secret_dir = cfg.root / "secret"
    secret_dir.mkdir(mode=0o755)
    root_only = write_st(secret_dir / "model.safetensors", tensors(3))
    os.chmod(root_only, 0o600)

    Client(cfg).call("job.register", job_id="100", uid=0, user="root")
    Client(cfg).call("job.register", job_id="200", uid=user_uid, user=TEST_USER)

    out = as_user(user_uid, _user_imports, cfg, str(own), str(sharded), str(root_only))

    pool = Pool.from_config(cfg)
    own_m = out["own"]
    assert own_m["name"] == "own" and out["own_again"] == own_m["digest"]
    want = {k: np.ascontiguousarray(v).tobytes() for k, v in tensors(1).items()}
    assert _data(pool, own_m["digest"]) == want
    assert out["sharded"]["name"] == "shardy"
    assert set(_data(pool, out["sharded"]["digest"])) == set(tensors(2)) | {"extra"}
    # sources are keyed by the importing uid and the file's inode, never a path to reopen
    assert all(s["path"].startswith(f"/fd-import/uid{user_uid}/") for s in own_m["sources"])
    assert out["root_only"].startswith("InvalidCheckpoint: ") and "permission denied" in \
        out["root_only"], out["root_only"]  # fmt: skip
    assert out["o_path"].startswith("InvalidCheckpoint: model.safetensors: descriptor not "
                                    "opened for reading"), out["o_path"]  # fmt: skip
    assert out["fd_count"].startswith("ProtocolError: pool.import names 2 file(s) but 1")
    assert out["fd_on_ping"].startswith("ProtocolError: ping takes no file descriptors")
    assert out["bad_name"].startswith("InvalidCheckpoint: file name '../model.safetensors'")
    assert out["read_only"] is True and out["listed"] == ["own", "shardy"]
    assert out["direct_import"].startswith("PermissionDenied: cannot import"), out
    assert out["direct_use"].startswith("PermissionDenied: cannot change the pool: the pool (")
    for key in ("write_index", "write_data", "new_file"):
        assert out[key].startswith("PermissionError: "), (key, out[key])
    # nothing of the root-only file got in; everything in the pool is root's, 0644/0755,
    # but the locks (root's alone: a user's flock on one would stop the pool's writers)
    assert sorted(e.manifest.name for e in pool.entries()) == ["own", "shardy"]
    # the event log: one line per new entry (not the import that found "own" there), in
    # the caller's name, with its job only where the job is the caller's
    imports = [e for e in events.tail(cfg.paths.events, 100) if e["kind"] == "pool.import"]
    assert [(e["detail"]["name"], e["job_id"], e["uid"]) for e in imports] == [
        ("own", None, user_uid), ("shardy", "200", user_uid)]  # fmt: skip
    locks = pool.pool_dir / ".locks"
    for p in [pool.pool_dir, *pool.pool_dir.rglob("*")]:
        st = os.lstat(p)
        assert st.st_uid == 0, p
        want = (0o700 if p == locks else 0o600) if locks in (p, *p.parents) \
            else 0o755 if p.is_dir() else 0o644  # fmt: skip
        assert stat.S_IMODE(st.st_mode) == want, p


def _hold_use(cfg: Config, ref: str, wfd: int) -> None:
    with access.use_entry(cfg, ref) as m:
        os.write(wfd, json.dumps([os.getpid(), m.digest]).encode() + b"\n")
        time.sleep(60)  # killed by the test


def _use_and_leave(cfg: Config, ref: str) -> dict[str, Any]:
    out: dict[str, Any] = {"pid": os.getpid()}
    with access.use_entry(cfg, ref) as m:
        rec = Pool.from_config(cfg).index.read_unlocked().entries[m.digest]
        out["during"] = [[h.pid, h.uid] for h in rec.uses]
        # pool.unuse drops the caller's own use, then finds none: root's use stays
        out["unuse_own"] = Client(cfg).call("pool.unuse", ref=ref)["released"]
        out["unuse_again"] = Client(cfg).call("pool.unuse", ref=ref)["released"]
        # no lock file of the pool opens for a user (a flock would need no more)
        out["open_index_lock"] = outcome(open, Pool.from_config(cfg).index.lock_path("index.lock"))
    rec = Pool.from_config(cfg).index.read_unlocked().entries[m.digest]
    out["after"] = [[h.pid, h.uid] for h in rec.uses]
    return out


def test_pool_use_is_held_by_the_users_process(cfg: Config, daemon: int, user_uid: int) -> None:
    src = write_st(cfg.root / "m.safetensors", tensors(4))
    m = access.import_model(cfg, src, name="shared")  # root: the direct path
    pool = Pool.from_config(cfg)
    with access.use_entry(cfg, "shared"):  # root's own use, which the user cannot drop
        out = as_user(user_uid, _use_and_leave, cfg, "shared")
        assert sorted(map(tuple, out["during"])) == sorted(
            [(os.getpid(), 0), (out["pid"], user_uid)]
        )
        assert (out["unuse_own"], out["unuse_again"]) == (True, False)
        assert out["open_index_lock"].startswith("PermissionError: "), out
        assert out["after"] == [[os.getpid(), 0]]
    assert pool.index.read_unlocked().entries[m.digest].uses == []

    rfd, wfd = os.pipe()
    child = spawn_as(user_uid, _hold_use, cfg, "shared", wfd)
    os.close(wfd)
    with os.fdopen(rfd) as f:
        pid, digest = json.loads(f.readline())
    assert pid == child.pid and digest == m.digest
    users = pool.entries()[0].users
    assert [(h.pid, h.uid) for h in users] == [(child.pid, user_uid)]
    # in use: eviction and removal refuse it
    assert outcome(pool.remove, "shared").startswith("PoolEntryInUse: ")
    os.kill(child.pid, signal.SIGKILL)
    os.waitpid(child.pid, 0)
    os.close(child.rfd)
    assert pool.entries()[0].users == []  # the dead holder no longer counts
    pool.ensure_room(0)  # any locked write prunes it from index.json for good
    raw = json.loads(pool.index.path.read_text())
    assert raw["entries"][m.digest]["uses"] == []
    assert pool.remove("shared").digest == m.digest


@pytest.mark.parametrize("daemon_running", [False, True])
def test_root_takes_the_direct_path(cfg: Config, daemon_running: bool) -> None:
    from spswap.daemon import lifecycle

    if daemon_running:
        lifecycle.start(cfg, wait_s=15.0)
    # without a daemon this only works because root writes the files itself
    src = write_st(cfg.root / "m.safetensors", tensors(5))
    m = access.import_model(cfg, src)
    with access.use_entry(cfg, m.digest) as used:
        holders = Pool.from_config(cfg).entries()[0].users
        assert [(h.pid, h.uid) for h in holders] == [(os.getpid(), 0)]
    assert used.digest == m.digest
    r = access.reserve_slot(cfg, model="m", units=1, allowed_gpus=[0], timeout_s=5)
    assert (r.holder.pid, r.holder.uid) == (os.getpid(), 0)
    access.release_slot(cfg, r.id)
    events = cfg.paths.events
    logged = events.read_text() if events.exists() else ""
    assert "slots.reserve" not in logged and "pool.import" not in logged


def _no_daemon(cfg: Config) -> str:
    return outcome(access.reserve_slot, cfg, model="m", units=1, timeout_s=1)


def test_user_without_daemon_is_told_to_start_it(cfg: Config, user_uid: int) -> None:
    msg = as_user(user_uid, _no_daemon, cfg)
    assert msg.startswith("DaemonError: spswapd is not reachable") and \
        "spswap daemon start" in msg and "prolog.log" in msg, msg  # fmt: skip


LAYOUT = {"engine": "vllm", "vllm": "0.26.0", "tp_size": 1, "rank": 0, "dtype": "bfloat16",
          "model_config_hash": "c0ffee"}  # fmt: skip


def _import_with_identity(cfg: Config, path: str, claimed_owner: int) -> dict[str, Any]:
    m = access.import_model(
        cfg, path, name="exported", identity={**LAYOUT, "owner_uid": claimed_owner}
    )
    return m.to_json()


def test_exports_are_stamped_with_the_importing_users_uid(
    cfg: Config, daemon: int, user_uid: int
) -> None:
    """An engine export imported through spswapd carries the importer's uid, whatever the
    caller claimed, and only that user (or root) trusts it: no user can plant weights
    that another user's engine would load."""
    from spswap.engines.vllm_identity import find_entry, trusted_owner

    home = _user_dir(cfg, user_uid)
    path = write_st(home / "export.safetensors", tensors(5))
    _chown_tree(path, user_uid)
    out = as_user(user_uid, _import_with_identity, cfg, str(path), 0)  # claims root
    assert out["identity"] == {**LAYOUT, "owner_uid": user_uid}
    pool = Pool.from_config(cfg)
    assert trusted_owner(out["identity"], user_uid) and not trusted_owner(out["identity"], 4242)
    assert not trusted_owner(out["identity"], 0)  # root, too, loads only its own exports
    assert find_entry(pool, LAYOUT, uid=user_uid).digest == out["digest"]
    assert find_entry(pool, LAYOUT, uid=user_uid + 1) is None
    assert find_entry(pool, LAYOUT, uid=0) is None
    # root exports the very same bytes: the entry stays the user's (same digest), and root
    # now finds it under its own uid (an alias), and so does everyone (root's exports are
    # trusted); the entry itself still says who exported it first
    root_copy = write_st(cfg.root / "root-export.safetensors", tensors(5))
    again = access.import_model(cfg, root_copy, name="exported-again", identity=LAYOUT)
    assert again.digest == out["digest"] and again.identity["owner_uid"] == user_uid
    assert find_entry(pool, LAYOUT, uid=0).digest == out["digest"]
    assert find_entry(pool, LAYOUT, uid=user_uid + 1).digest == out["digest"]
    pool.remove(out["digest"])
    assert find_entry(pool, LAYOUT, uid=0) is None  # aliases go with their entry
    assert pool.index.read_unlocked().aliases == {}
