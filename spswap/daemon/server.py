"""The daemon's Unix-socket server: one thread per connection, one JSON line per request.

The caller is identified by the kernel (``SO_PEERCRED``), never by what it claims.
Nothing a client sends can stop the server: malformed, oversized, half-sent or slow
messages get an error answer (or the connection is closed) and the next client is
served as before.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from spswap.config import Config
from spswap.daemon import protocol
from spswap.daemon.ops import HANDLERS
from spswap.daemon.state import Context, DaemonState
from spswap.errors import DaemonError, ProtocolError, SpswapError

READ_TIMEOUT_S = 10.0
"""A client that sends no complete line within this time is answered and dropped."""
ACCEPT_POLL_S = 0.5
# One user's connections at once (each holds a thread; a reservation waiting in line holds
# its connection): enough for the jobs of a full node, not for a flood that would leave
# other users' prologs and jobs without the daemon.
MAX_CONNECTIONS_PER_UID = 64


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int


def peer_credentials(conn: socket.socket) -> Peer:
    """The connecting process's pid, uid and gid as the kernel saw them at connect()."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid=pid, uid=uid, gid=gid)


class LineTooLong(Exception):
    pass


def read_line(conn: socket.socket, buf: bytearray, fds: list[int] | None = None,
              deadline: float | None = None) -> bytes | None:  # fmt: skip
    """The next line (newline included) from ``conn``; None at a clean EOF.

    With ``fds``, file descriptors passed along (SCM_RIGHTS) are appended to it; the
    caller owns and must close them. Raises :class:`LineTooLong` past
    :data:`protocol.MAX_MESSAGE_BYTES` or :data:`protocol.MAX_FDS` descriptors, and
    ``TimeoutError`` when the line is not complete by ``deadline`` (monotonic; a
    client that sends a byte now and then must not hold a thread forever) or the
    socket's own timeout passes without a byte. The socket's timeout is as it was after.
    """
    if deadline is None:
        return _read_line(conn, buf, fds, None)
    timeout_s = conn.gettimeout()
    try:
        return _read_line(conn, buf, fds, deadline)
    finally:
        conn.settimeout(timeout_s)  # what the answer is sent with


def _read_line(conn: socket.socket, buf: bytearray, fds: list[int] | None,
               deadline: float | None) -> bytes | None:  # fmt: skip
    while True:
        nl = buf.find(b"\n")
        if nl >= 0:
            line = bytes(buf[: nl + 1])
            del buf[: nl + 1]
            return line
        if len(buf) > protocol.MAX_MESSAGE_BYTES:
            raise LineTooLong()
        if deadline is not None:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise TimeoutError()
            conn.settimeout(left_s)
        if fds is None:
            chunk = conn.recv(1 << 16)
        else:
            chunk, got, flags, _ = socket.recv_fds(conn, 1 << 16, protocol.MAX_FDS)
            fds.extend(got)
            if flags & socket.MSG_CTRUNC or len(fds) > protocol.MAX_FDS:
                raise LineTooLong()  # more descriptors than one request may carry
        if not chunk:
            return None  # EOF; an unterminated tail is dropped (the client gave up)
        buf += chunk


class Server:
    """Serves ``cfg.paths.socket`` until :meth:`shutdown`."""

    def __init__(self, cfg: Config, *, read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.cfg = cfg
        self.read_timeout_s = read_timeout_s
        self.state = DaemonState(cfg)
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._sock_ino = 0
        self.orphaned = False
        self._conns: dict[int, int] = {}  # uid -> connections being served
        self._conns_lock = threading.Lock()

    def bind(self) -> None:
        """Bind the socket (a stale one from a crashed daemon is removed first)."""
        path = self.cfg.paths.socket
        if len(os.fsencode(str(path))) > 107:
            raise DaemonError(
                f"socket path {path} is longer than the 107 bytes Unix sockets allow; "
                "use a shorter SPSWAP_ROOT"
            )
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # anyone may connect (0666: every request is authorized by the caller's uid); set
        # by the umask at bind time, since a chmod by path would follow a symlink
        old = os.umask(0o111)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        sock.listen(128)
        sock.settimeout(ACCEPT_POLL_S)
        self._sock = sock
        self._sock_ino = os.stat(path).st_ino

    def _socket_is_ours(self) -> bool:
        # A root deleted under us (rm -rf, a test's temp dir) or a second daemon that
        # took over the path: this one can no longer be reached, so it must not linger.
        try:
            return os.stat(self.cfg.paths.socket).st_ino == self._sock_ino
        except FileNotFoundError:
            return False

    def serve_forever(self) -> None:
        assert self._sock is not None, "bind() first"
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                if not self._socket_is_ours():
                    sys.stderr.write(f"{time.strftime('%F %T')} spswapd: {self.cfg.paths.socket} "
                                     "was removed or replaced; exiting\n")  # fmt: skip
                    sys.stderr.flush()
                    self.orphaned = True
                    break
                continue
            except OSError as e:
                if self._stop.is_set():
                    break
                # out of descriptors or memory (a client flooding us): refuse for a moment,
                # never die; every other user depends on this daemon
                sys.stderr.write(f"{time.strftime('%F %T')} spswapd: accept failed: {e}\n")
                sys.stderr.flush()
                time.sleep(ACCEPT_POLL_S)
                continue
            try:
                threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()
            except RuntimeError as e:  # no thread to be had (a flood): refuse, never die
                conn.close()
                sys.stderr.write(f"{time.strftime('%F %T')} spswapd: no thread for a "
                                 f"connection: {e}\n")  # fmt: skip
                sys.stderr.flush()
                time.sleep(ACCEPT_POLL_S)

    def shutdown(self) -> None:
        self._stop.set()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            if self._socket_is_ours():
                self.cfg.paths.socket.unlink()

    # -- one connection ----------------------------------------------------------------

    def _serve_conn(self, conn: socket.socket) -> None:
        with conn:
            peer = None
            fds: list[int] = []
            try:
                peer = peer_credentials(conn)
                conn.settimeout(self.read_timeout_s)
                if not self._admit(peer.uid):
                    self._refuse(conn, f"uid {peer.uid} has {MAX_CONNECTIONS_PER_UID} "
                                 "connections to spswapd open already; close some (or wait "
                                 "for them to end) and try again")  # fmt: skip
                    peer = None  # not counted
                    return
                buf = bytearray()
                while True:
                    try:
                        line = read_line(conn, buf, fds,
                                         deadline=time.monotonic() + self.read_timeout_s)
                    except LineTooLong:
                        limit = protocol.MAX_MESSAGE_BYTES
                        self._refuse(conn, f"message is larger than the limit of {limit} bytes "
                                     f"or carries more than {protocol.MAX_FDS} descriptors; "
                                     "send smaller requests")  # fmt: skip
                        return
                    except TimeoutError:
                        self._refuse(conn, f"no complete message within {self.read_timeout_s:g} "
                                     "s; end each request with a newline")  # fmt: skip
                        return
                    if line is None:
                        return
                    # descriptors travel with the request they arrived with, and only it
                    taken, fds[:] = tuple(fds), []
                    try:
                        response = self.handle_line(line, peer, taken)
                    finally:
                        _close_all(taken)
                    self._send(conn, response)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client left: nothing to answer
            except Exception:
                self._log_exception("connection")
            finally:
                _close_all(fds)
                if peer is not None:
                    self._leave(peer.uid)

    def _admit(self, uid: int) -> bool:
        """Count a connection of ``uid``; False past :data:`MAX_CONNECTIONS_PER_UID` (root
        has no cap: the prolog and epilog must always get through)."""
        with self._conns_lock:
            if uid != 0 and self._conns.get(uid, 0) >= MAX_CONNECTIONS_PER_UID:
                return False
            self._conns[uid] = self._conns.get(uid, 0) + 1
            return True

    def _leave(self, uid: int) -> None:
        with self._conns_lock:
            self._conns[uid] -= 1
            if not self._conns[uid]:
                del self._conns[uid]

    def handle_line(self, line: bytes, peer: Peer, fds: tuple[int, ...] = ()) -> dict[str, Any]:
        """The response to one request line from ``peer`` (never raises).

        ``fds``: descriptors that came with the line; the caller closes them afterwards.
        """
        op = "?"
        try:
            req = protocol.decode_request(line)
            op = req.op
            if fds and op not in protocol.FD_OPS:
                raise ProtocolError(f"{op} takes no file descriptors; send them only with "
                                    f"{', '.join(sorted(protocol.FD_OPS))}")  # fmt: skip
            ctx = Context(peer_uid=peer.uid, peer_pid=peer.pid, state=self.state, fds=fds)
            return protocol.ok(HANDLERS[req.op](ctx, req.args))
        except ProtocolError as e:
            return protocol.error("ProtocolError", str(e))
        except SpswapError as e:
            return protocol.error(type(e).__name__, str(e))
        except Exception as e:
            self._log_exception(f"op {op}")
            return protocol.error(
                "DaemonError",
                f"internal error in {op}: {type(e).__name__}: {e}; the traceback is in "
                f"{self.cfg.paths.log / 'spswapd.log'}",
            )

    @staticmethod
    def _refuse(conn: socket.socket, message: str) -> None:
        """Answer a message that can't be read as a request (the connection then closes)."""
        conn.sendall(protocol.encode(protocol.error("ProtocolError", message)))

    @staticmethod
    def _send(conn: socket.socket, msg: dict[str, Any]) -> None:
        conn.sendall(protocol.encode(msg))

    @staticmethod
    def _log_exception(where: str) -> None:
        stamp = time.strftime("%F %T")
        sys.stderr.write(f"{stamp} spswapd: error in {where}:\n{traceback.format_exc()}")
        sys.stderr.flush()


def _close_all(fds: list[int] | tuple[int, ...]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    if isinstance(fds, list):
        fds.clear()


def install_signal_handlers(server: Server) -> None:
    def stop(signum: int, _frame: object) -> None:
        server.shutdown()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the prolog's session may hang up
