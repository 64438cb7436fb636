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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spswap.config import Config
from spswap.daemon import protocol
from spswap.daemon.budget import Budget
from spswap.daemon.ops import HANDLERS
from spswap.daemon.state import Context, DaemonState
from spswap.errors import ConfigError, ProtocolError, SpswapError

READ_TIMEOUT_S = 10.0
"""A client that sends no complete line within this time is answered and dropped."""
ACCEPT_POLL_S = 0.5


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


class OverBudget(Exception):
    """Descriptors came that the sender's share (see :mod:`spswap.daemon.budget`) had no
    room for; the kernel closed them unread."""


Grant = Callable[[int], int]
"""Room for up to n more passed descriptors (the rest is handed back with a negative n)."""


def read_line(conn: socket.socket, buf: bytearray, fds: list[int] | None = None,
              deadline: float | None = None,
              grant: Grant | None = None) -> bytes | None:  # fmt: skip
    """The next line (newline included) from ``conn``; None at a clean EOF.

    With ``fds``, file descriptors passed along (SCM_RIGHTS) are appended to it; the
    caller owns and must close them. Raises :class:`LineTooLong` past
    :data:`protocol.MAX_MESSAGE_BYTES` or :data:`protocol.MAX_FDS` descriptors, and
    ``TimeoutError`` when the line is not complete by ``deadline`` (monotonic; a
    client that sends a byte now and then must not hold a thread forever) or the
    socket's own timeout passes without a byte. The socket's timeout is as it was after.
    With ``grant``, no more descriptors are taken in than it gives room for
    (:class:`OverBudget` when more came); it is handed back what was not used.
    """
    if deadline is None:
        return _read_line(conn, buf, fds, None, grant)
    timeout_s = conn.gettimeout()
    try:
        return _read_line(conn, buf, fds, deadline, grant)
    finally:
        conn.settimeout(timeout_s)  # what the answer is sent with


def _read_line(conn: socket.socket, buf: bytearray, fds: list[int] | None,
               deadline: float | None, grant: Grant | None) -> bytes | None:  # fmt: skip
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
            chunk, flags, room = _recv_with_fds(conn, fds, grant)
            if flags & socket.MSG_CTRUNC and room < protocol.MAX_FDS:
                raise OverBudget()
            if flags & socket.MSG_CTRUNC or len(fds) > protocol.MAX_FDS:
                raise LineTooLong()  # more descriptors than one request may carry
        if not chunk:
            return None  # EOF; an unterminated tail is dropped (the client gave up)
        buf += chunk


def _recv_with_fds(conn: socket.socket, fds: list[int],
                   grant: Grant | None) -> tuple[bytes, int, int]:  # fmt: skip
    """One read that takes in at most the descriptors there is room for (the kernel closes
    any beyond, and says so with MSG_CTRUNC): ``(data, flags, room)``.

    The room is asked for only once data is there (a peek takes in no descriptor), so
    a connection waiting for its client holds none of its user's share."""
    if grant:
        conn.recv(1, socket.MSG_PEEK)
    room = grant(protocol.MAX_FDS) if grant else protocol.MAX_FDS
    got: list[int] = []
    try:
        if room:
            chunk, got, flags, _ = socket.recv_fds(conn, 1 << 16, room)
        else:
            chunk, _anc, flags, _ = conn.recvmsg(1 << 16)
    finally:
        if grant:
            grant(len(got) - room)  # hand back what did not come
    fds.extend(got)
    return chunk, flags, room


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
        self.budget = Budget()

    def bind(self) -> None:
        """Bind the socket (a stale one from a crashed daemon is removed first)."""
        path = self.cfg.paths.socket
        if len(os.fsencode(str(path))) > 107:
            raise ConfigError(
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
            peer = self._admit(conn)
            if peer is None:
                continue
            try:
                threading.Thread(target=self._serve_conn, args=(conn, peer), daemon=True).start()
            except RuntimeError as e:  # no thread to be had (a flood): refuse, never die
                conn.close()
                self.budget.leave(peer.uid)
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

    def _admit(self, conn: socket.socket) -> Peer | None:
        """The caller, counted in its uid's share; None when it is over it (answered, in
        this thread: a refused connection must cost neither a thread nor a wait)."""
        try:
            peer = peer_credentials(conn)
        except OSError:
            conn.close()
            return None
        why = self.budget.admit(peer.uid)
        if why is None:
            return peer
        try:
            conn.setblocking(False)  # a short answer fits the new socket's empty buffer
            conn.send(protocol.encode(protocol.error("ProtocolError", why)))
        except OSError:
            pass
        conn.close()
        return None

    def _serve_conn(self, conn: socket.socket, peer: Peer) -> None:
        budget = self.budget

        def grant(n: int) -> int:
            if n < 0:
                budget.give(peer.uid, -n)
                return 0
            return budget.grant(peer.uid, n)

        with conn:
            fds: list[int] = []
            try:
                conn.settimeout(self.read_timeout_s)
                buf = bytearray()
                while True:
                    try:
                        line = read_line(
                            conn,
                            buf,
                            fds,
                            grant=grant,
                            deadline=time.monotonic() + self.read_timeout_s,
                        )
                    except OverBudget:
                        self._refuse(conn, budget.over_message(peer.uid))
                        return
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
                        budget.give(peer.uid, len(taken))
                    self._send(conn, response)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client left: nothing to answer
            except Exception:
                self._log_exception("connection")
            finally:
                budget.give(peer.uid, len(fds))
                _close_all(fds)
                budget.leave(peer.uid)

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
            self.state.requests.uid = peer.uid  # (this thread's: see DaemonState.requests)
            try:
                return protocol.ok(HANDLERS[req.op](ctx, req.args))
            finally:
                self.state.requests.uid = None
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
