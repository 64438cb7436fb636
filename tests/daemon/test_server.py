"""A real spswapd subprocess: ping/status, hostile clients, crash and restart."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

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
    assert per_call_ms < 100, per_call_ms  # no start, no wait: a start alone takes longer


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
    pid2 = lifecycle.ensure(cfg, wait_s=15)
    assert pid2 != daemon
    jobs = Client(cfg).call("jobs.list")
    assert [(j["job_id"], j["uid"], j["restart_count"]) for j in jobs] == [("501", 1234, 1)]
    held = [x["id"] for x in Client(cfg).call("slots.list")["reservations"]]
    assert held == [r.id]
    # the epilog path through the restarted daemon releases the job's reservation
    end = Client(cfg).call("job.end", job_id="501")
    assert end["released_reservations"] == [r.id] and end["state"] == "ended"
    assert table.reservations() == []


@pytest.mark.skipif(os.geteuid() != 0, reason="root's forced release of another's reservation")
def test_roots_release_of_anothers_reservation_is_in_the_event_log(
    cfg: Config, daemon: int
) -> None:
    """The walk: root's `spswap slots release` of a stuck holder's reservation wrote the
    table itself and left no event; with spswapd up it goes through spswapd, whose log
    then has it (the holder's event, by root)."""
    import dataclasses

    from spswap.access import release_slot

    table = SlotTable(cfg.paths.slots, [0])
    holder = dataclasses.replace(Holder.current(job_id="777"), uid=4242)  # another user's
    r = table.reserve(model="m", units=1, holder=holder, timeout_s=5)
    released = release_slot(cfg, r.id)
    assert released.id == r.id and table.reservations() == []
    events = Client(cfg).call("events.tail", n=20)
    (event,) = [e for e in events if e["kind"] == "slots.release"]
    assert (event["uid"], event["detail"]["by_uid"]) == (4242, 0), event
    assert event["detail"]["reservation"] == r.id and event["job_id"] == "777"


def test_second_start_is_a_no_op_and_stop(cfg: Config, daemon: int) -> None:
    # `ps -e`, `pgrep spswapd` and top name it as the docs do
    assert Path(f"/proc/{daemon}/comm").read_text().strip() == "spswapd"
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


def _in_process_server(cfg: Config, read_timeout_s: float) -> tuple[Server, threading.Thread]:
    lifecycle.prepare_dirs(cfg)
    server = Server(cfg, read_timeout_s=read_timeout_s)
    server.bind()
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    return server, t


def _stop(server: Server, t: threading.Thread) -> None:
    server.shutdown()
    t.join(5)
    server.close()


def test_a_trickling_client_is_cut_off_at_the_line_deadline(cfg: Config) -> None:
    """A byte now and then must not hold a daemon thread forever: the whole line has
    read_timeout_s, not each recv."""
    server, t = _in_process_server(cfg, read_timeout_s=0.5)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(cfg.paths.socket))
            s.settimeout(0.05)
            t0 = time.monotonic()
            answer = b""
            for byte in b'{"v":1,"op":"ping"' * 4:  # 72 bytes over ~3.6 s, never a newline
                try:
                    s.sendall(bytes([byte]))
                    answer += s.recv(4096)
                except TimeoutError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    break  # closed by the daemon: its answer may still wait in our buffer
                if answer.endswith(b"\n"):
                    break
                time.sleep(0.05)
            elapsed_s = time.monotonic() - t0
            s.settimeout(1.0)
            while not answer.endswith(b"\n"):  # a send can fail before the answer is read
                try:
                    more = s.recv(4096)
                except (TimeoutError, ConnectionResetError):
                    break
                if not more:
                    break
                answer += more
        assert "no complete message within 0.5 s" in _error(answer)["message"]
        assert elapsed_s < 3.5, elapsed_s  # not at the end of the trickle (over 7 s)
    finally:
        _stop(server, t)


def _open_idle(socket_path: str, n: int) -> list[str]:
    """(Run as another user) open ``n`` idle connections: what each got at once ('' for
    nothing: taken and waiting for a request)."""
    conns, got = [], []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(socket_path)
        conns.append(s)
        time.sleep(0.05)
    for s in conns:
        s.settimeout(0.5)
        try:
            got.append(s.recv(4096).decode())
        except TimeoutError:
            got.append("")
    for s in conns:
        s.close()
    return got


def test_one_user_cannot_take_every_connection(
    monkeypatch: pytest.MonkeyPatch, user_uid: int
) -> None:
    import spswap.daemon.budget as budget_mod
    from tests.uids import node_root, spawn_as

    monkeypatch.setattr(budget_mod, "MAX_CONNECTIONS_PER_UID", 3)
    with node_root("spsrv-") as cfg:
        server, t = _in_process_server(cfg, read_timeout_s=5)
        try:
            got = spawn_as(user_uid, _open_idle, str(cfg.paths.socket), 5).result()
            assert got[:3] == ["", "", ""], got  # taken, waiting for their requests
            for answer in got[3:]:
                assert "has 3 connections to spswapd open already" in answer, got
            assert Client(cfg).call("ping")["pong"] is True  # root is never capped
        finally:
            _stop(server, t)


def test_descriptors_are_capped_across_the_pieces_of_one_line(cfg: Config) -> None:
    """Descriptors that come with several pieces of one line count together: a client
    cannot make the daemon hold more than protocol.MAX_FDS of them."""
    server, t = _in_process_server(cfg, read_timeout_s=5)
    r, w = os.pipe()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(cfg.paths.socket))
            for _ in range(3):  # 3 x 100 > 256, none of them past the limit alone
                socket.send_fds(s, [b'{"v":1,'], [r] * 100)
                time.sleep(0.1)
            s.settimeout(5)
            answer = s.recv(4096)
        assert f"more than {protocol.MAX_FDS} descriptors" in _error(answer)["message"]
    finally:
        os.close(r)
        os.close(w)
        _stop(server, t)
