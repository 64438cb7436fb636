"""Talk to the node daemon: one request per connection, errors raised as spswap errors."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from spswap import errors
from spswap.config import Config
from spswap.daemon import protocol
from spswap.errors import BadRequest, DaemonError, SpswapError


class Client:
    """A client of the daemon serving ``cfg``'s root."""

    def __init__(self, cfg: Config, timeout_s: float = 30.0) -> None:
        self.cfg = cfg
        self.timeout_s = timeout_s

    def _unreachable(self, why: str) -> DaemonError:
        return DaemonError(
            f"spswapd is not reachable at {self.cfg.paths.socket} ({why}); start it with "
            f"`spswap daemon start` (as root), or see {self.cfg.paths.log / 'prolog.log'} "
            "for why the Slurm prolog could not"
        )

    def call(self, op: str, **args: Any) -> Any:
        """Send ``op`` and return its result; raises the daemon's error as its spswap type."""
        return self.call_with_fds(op, (), **args)

    def call_with_fds(self, op: str, fds: Sequence[int], **args: Any) -> Any:
        """Like :meth:`call`, passing open file descriptors along (SCM_RIGHTS).

        The daemon gets its own copies; the caller still owns (and closes) ``fds``.
        """
        if len(fds) > protocol.MAX_FDS:
            raise BadRequest(f"{len(fds)} files in one request; at most {protocol.MAX_FDS}")
        line = protocol.encode(protocol.request(op, **args))
        sock = self._connect()
        try:
            try:
                if fds:
                    # the descriptors ride on the first bytes; the rest follows plainly
                    sent = socket.send_fds(sock, [line], list(fds))
                    sock.sendall(line[sent:])
                else:
                    sock.sendall(line)
                reply = _read_line(sock)
            except TimeoutError:
                raise DaemonError(
                    f"spswapd did not answer {op} within {self.timeout_s:g} s"
                ) from None
            except OSError as e:
                raise self._unreachable(f"connection failed: {e}") from None
        finally:
            sock.close()
        if not reply:
            raise self._unreachable("it closed the connection without an answer")
        response = protocol.decode_response(reply)
        if response["ok"]:
            return response["result"]
        raise error_from_response(response["error"])

    def notify(self, op: str, **args: Any) -> None:
        """Send ``op`` and go on without waiting for its answer (which is dropped): for a
        hint whose outcome changes nothing for the caller. Raises as :meth:`call` does
        when the daemon cannot be reached or its socket is not root's."""
        line = protocol.encode(protocol.request(op, **args))
        sock = self._connect()
        try:
            sock.sendall(line)
        except OSError as e:
            raise self._unreachable(f"connection failed: {e}") from None
        finally:
            sock.close()

    def _connect(self) -> socket.socket:
        """A connection to the daemon, checked to be root's before a byte goes out."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(str(self.cfg.paths.socket))
            except (FileNotFoundError, ConnectionRefusedError) as e:
                raise self._unreachable(e.strerror or type(e).__name__) from None
            except PermissionError:
                raise self._unreachable("permission denied on the socket") from None
            except TimeoutError:
                raise self._unreachable("connect timed out") from None
            except OSError as e:  # e.g. "AF_UNIX path too long"
                raise self._unreachable(str(e)) from None
            from spswap.daemon.trust import check_server

            check_server(sock, self.cfg.paths.socket)  # before a byte (or a file) goes out
        except BaseException:
            sock.close()
            raise
        return sock


def _read_line(sock: socket.socket) -> bytes:
    buf = bytearray()
    # a line past the bound is cut here and refused by decode_response: no endless read
    while b"\n" not in buf and len(buf) <= protocol.MAX_RESPONSE_BYTES:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def error_from_response(err: dict[str, Any]) -> SpswapError:
    """The spswap error named in a response (a :class:`DaemonError` when unknown)."""
    message = str(err.get("message", "the daemon gave no reason"))
    cls = getattr(errors, str(err.get("type", "")), None)
    if isinstance(cls, type) and issubclass(cls, SpswapError):
        if cls is errors.SlotTimeout:  # the holders are in the message already
            return errors.SlotTimeout(message, holders=[])
        if cls is errors.PoolFull:  # and the sizes
            return errors.PoolFull(message, needed_bytes=0, free_bytes=0)
        try:
            return cls(message)
        except TypeError:  # needs more than a message: keep the text
            pass
    return DaemonError(f"spswapd: {message}")
