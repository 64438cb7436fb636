"""One user's idle connections, each with descriptors passed, cannot use up spswapd's
descriptor table: at a low RLIMIT_NOFILE another user's import still works, and the
flooder is told why it was refused (issue 19, item 4)."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from spswap import access
from spswap.config import Config
from spswap.daemon import lifecycle
from spswap.daemon.client import Client
from tests.pool.st_files import tensors, write_st
from tests.security.conftest import as_user, spawn_as

LIMIT = 256
FDS_PER_CONN = 8
ATTEMPTS = 300


def _start_at_limit(cfg: Config, limit: int) -> int:
    """spswapd as root whose soft and hard descriptor limits are both ``limit``."""
    lifecycle.prepare_dirs(cfg)

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    with open(lifecycle.log_path(cfg), "ab") as log:
        proc = subprocess.Popen(
            lifecycle.daemon_argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            env={**os.environ, "SPSWAP_ROOT": str(cfg.root)}, cwd="/",
            start_new_session=True, preexec_fn=low_limit,
        )  # fmt: skip
    proc.returncode = 0  # lifecycle.stop reaps it
    return lifecycle._wait_ready(cfg, proc.pid, time.monotonic() + 15)


def _flood(socket_path: str, ready: str, stop: str) -> dict[str, Any]:
    """(The attacker) connections that each pass descriptors with half a request and stay
    idle, topped up whenever one is refused, until 64 (the cap on connections) are held."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    src = os.open("/dev/null", os.O_RDONLY)
    held: list[socket.socket] = []
    told: list[str] = []
    for _ in range(ATTEMPTS):
        if len(held) >= 64:
            break
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(socket_path)
            n = FDS_PER_CONN if len(held) < 20 else 1  # big ones first, then fill the gaps
            socket.send_fds(s, [b'{"v":1,"op":"pool.import"'], [src] * n)
            # a refusal may come late on a loaded machine: only a connection spswapd took
            # in (it waits for the rest of the request) is silent for a whole second
            s.settimeout(1.0)
            told.append(s.recv(4096).decode())
            s.close()
        except TimeoutError:
            held.append(s)  # taken in, waiting for the rest of its request
        except OSError as e:
            told.append(str(e))
            s.close()
    Path(ready).write_text("")
    deadline = time.monotonic() + 30
    while not os.path.exists(stop) and time.monotonic() < deadline:
        time.sleep(0.01)
    for s in held:
        s.close()
    return {"held": len(held), "told": told}


def _victim(cfg: Config, path: str) -> dict[str, Any]:
    t0 = time.monotonic()
    pong = Client(cfg, timeout_s=5).call("ping")["pong"]
    m = access.import_model(cfg, path, name="victim", timeout_s=10)
    return {"pong": pong, "digest": m.digest, "s": time.monotonic() - t0}


def test_one_users_descriptors_do_not_fail_another_users_import(
    cfg: Config, user_uid: int, other_uid: int
) -> None:
    _start_at_limit(cfg, LIMIT)
    home = cfg.root / "home"
    home.mkdir(mode=0o700)
    model = write_st(home / "m.safetensors", tensors(21))
    for p in (home, model):
        os.chown(p, other_uid, -1)
    flags = cfg.root / "flags"  # the attacker's: it says there when it holds its connections
    flags.mkdir(mode=0o755)
    os.chown(flags, user_uid, -1)
    ready, stop = flags / "ready", cfg.root / "stop"
    attacker = spawn_as(user_uid, _flood, str(cfg.paths.socket), str(ready), str(stop))
    try:
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ready.exists()
        out = as_user(other_uid, _victim, cfg, str(model))
    finally:
        stop.write_text("")
        flood = attacker.result()
    assert out["pong"] is True and out["s"] < 5, out  # (held ones drop after 10 s)
    # the flooder holds a few connections, within its share; the rest were told why
    assert 0 < flood["held"] * (FDS_PER_CONN + 1) <= LIMIT // 8, flood
    share = [t for t in flood["told"] if "at its share of spswapd's descriptors" in t]
    closed = [t for t in flood["told"] if "Broken pipe" in t or "reset by peer" in t]
    assert share and len(share) + len(closed) == len(flood["told"]), flood  # told, or closed
    assert Client(cfg).call("ping")["pong"] is True


def test_shares_leave_the_daemon_a_reserve() -> None:
    from spswap.daemon.budget import Budget, fd_share

    assert fd_share(1024) == (112, 896) and fd_share(65536) == (2048, 57344)
    assert fd_share(256) == (24, 192)
    b = Budget(limit=256)
    assert b.admit(1000) is None and b.grant(1000, 100) == 23 and b.held(1000) == 24
    assert "at its share" in (b.admit(1000) or "")
    assert b.admit(0) is None and b.grant(0, 500) == 500  # root: never capped nor counted
    b.give(1000, 23)
    b.leave(1000)
    assert b.held(1000) == 0


def _raised(soft: int, hard: int) -> list[int]:
    from spswap.daemon.budget import raise_fd_limit

    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return [raise_fd_limit(), *resource.getrlimit(resource.RLIMIT_NOFILE)]


def test_the_daemon_raises_its_soft_limit(user_uid: int) -> None:
    """systemd's soft 1024 goes up to the hard limit, but no further than 65536."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert as_user(user_uid, _raised, 256, 4096) == [4096, 4096, 4096]
    if hard > 65536:
        assert as_user(user_uid, _raised, 1024, hard) == [65536, 65536, hard]
