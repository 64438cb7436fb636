"""A real spswapd subprocess: ping/status, hostile clients, crash and restart."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import pytest

from spswap.config import Config
from spswap.daemon import lifecycle, protocol
from spswap.daemon.client import Client
from spswap.daemon.server import Server
from spswap.errors import DaemonError
from spswap.liveness import Holder
from spswap.slots.table import SlotTable
from tests.daemon.conftest import exchange


def _error(raw: bytes) -> dict:
    lines = raw.splitlines()
    assert len(lines) == 1, raw
    msg = json.loads(lines[0])
    assert msg["ok"] is False and msg["v"] == 1
    return msg["error"]


def test_ping_and_status(cfg: Config, daemon: int) -> None:
    c = Client(cfg)
    assert c.call("ping") == {"pong": True, "pid": daemon, "protocol": 1}
    st = c.call("status")
    assert st["pid"] == daemon and st["root"] == str(cfg.root) and st["uptime_s"] >= 0
    assert lifecycle.daemon_running(cfg) == daemon
    assert oct(os.stat(cfg.paths.socket).st_mode & 0o777) == "0o666"
    assert oct(os.stat(cfg.paths.run).st_mode & 0o777) == "0o755"
    kinds = [e["kind"] for e in c.call("events.tail", n=10)]
    assert kinds == ["daemon.start"]


def test_ensure_is_idempotent_and_fast(cfg: Config, daemon: int) -> None:
    t0 = time.perf_counter()
    for _ in range(20):
        assert lifecycle.ensure(cfg) == daemon
    per_call_ms = (time.perf_counter() - t0) * 1000 / 20
    assert per_call_ms < 20, per_call_ms


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"garbage\n", "not UTF-8 JSON"),
        (b'{"v":1,"op":"format-disk"}\n', "unknown op"),
        (b'{"v":9,"op":"ping"}\n', "protocol version 9"),
        (b'{"v":1,"op":"slots.release","args":{"reservation_id":3}}\n', "must be str"),
        (b"x" * (protocol.MAX_MESSAGE_BYTES + 10), "larger than the limit of 65536 bytes"),
        (
            b'{"v":1,"op":"ping","args":{"p":"' + b"y" * 70000 + b'"}}\n',
            "larger than the limit of 65536 bytes",
        ),
    ],
)
def test_hostile_messages_answered(cfg: Config, daemon: int, data: bytes, needle: str) -> None:
    err = _error(exchange(cfg, data))
    assert err["type"] == "ProtocolError" and needle in err["message"]
    assert Client(cfg).call("ping")["pid"] == daemon


def test_half_line_then_close_and_many_per_connection(cfg: Config, daemon: int) -> None:
    assert exchange(cfg, b'{"v":1,"op":"pi') == b""  # nothing to answer: client gave up
    raw = exchange(cfg, b'{"v":1,"op":"ping"}\nnope\n{"v":1,"op":"ping"}\n')
    oks = [json.loads(x)["ok"] for x in raw.splitlines()]
    assert oks == [True, False, True]
    # a client that connects and vanishes without sending anything
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(cfg.paths.socket))
    s.close()
    assert Client(cfg).call("ping")["pid"] == daemon


def test_silent_client_times_out_in_process(cfg: Config) -> None:
    lifecycle.prepare_dirs(cfg)
    server = Server(cfg, read_timeout_s=0.3)
    server.bind()
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        t0 = time.monotonic()
        err = _error(exchange(cfg, b'{"v":1,"op":"ping"', close_write=False))
        assert "no complete message within 0.3 s" in err["message"]
        assert time.monotonic() - t0 < 5
        assert Client(cfg).call("ping")["pong"] is True
    finally:
        server.shutdown()
        t.join(5)
        server.close()
    assert not cfg.paths.socket.exists()


def test_unreachable_daemon_says_what_to_do(cfg: Config) -> None:
    with pytest.raises(DaemonError, match="spswap daemon start.*prolog.log"):
        Client(cfg).call("ping")


def test_crash_then_ensure_restarts_with_state(cfg: Config, daemon: int) -> None:
    c = Client(cfg)
    c.call("job.register", job_id="501", uid=1234, user="u", gpus=[0], restart_count=1)
    table = SlotTable(cfg.paths.slots, [0])
    r = table.reserve(model="m", units=2, holder=Holder.current(job_id="501"), timeout_s=5)
    os.kill(daemon, signal.SIGKILL)
    os.waitpid(daemon, 0)
    assert lifecycle.daemon_running(cfg) is None  # pid file stays, its lock is gone
    assert cfg.paths.socket.exists()  # stale socket left behind
    pid2 = lifecycle.ensure(cfg)
    assert pid2 != daemon
    jobs = Client(cfg).call("jobs.list")
    assert [(j["job_id"], j["uid"], j["restart_count"]) for j in jobs] == [("501", 1234, 1)]
    held = [x["id"] for x in Client(cfg).call("slots.list")["reservations"]]
    assert held == [r.id]
    # the epilog path through the restarted daemon releases the job's reservation
    end = Client(cfg).call("job.end", job_id="501")
    assert end["released_reservations"] == [r.id] and end["state"] == "ended"
    assert table.reservations() == []


def test_second_start_is_a_no_op_and_stop(cfg: Config, daemon: int) -> None:
    assert lifecycle.start(cfg) == daemon
    assert lifecycle.stop(cfg) == daemon
    assert lifecycle.daemon_running(cfg) is None
    assert not cfg.paths.socket.exists()
    assert lifecycle.stop(cfg) is None
    kinds = [json.loads(x)["kind"] for x in cfg.paths.events.read_bytes().splitlines()]
    assert kinds == ["daemon.start", "daemon.stop"]


def test_daemon_exits_when_its_root_is_removed(cfg: Config, daemon: int) -> None:
    import shutil

    shutil.rmtree(cfg.root)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, _ = os.waitpid(daemon, os.WNOHANG)
        if done == daemon:
            break
        time.sleep(0.05)
    else:
        pytest.fail("spswapd kept running after its root was removed")
    assert not cfg.root.exists()  # it recreated nothing on the way out
