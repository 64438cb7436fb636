"""A small Unix-socket front door for ``spswap serve``: one JSON request per line, one
JSON answer per line, on a socket only the job's user can reach (mode 0600).

Every request is first written to the spool (that is what makes it survive a preemption);
the connection then waits for its answer in the outbox. On a stop the front closes its
listening socket and every client connection (a dump cannot carry connections to outside
peers): a waiting client is told its request was saved and where its answer will be.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import stat
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spswap.errors import SpswapError
from spswap.serve.spool import Request, Spool, answered, fetch_id, not_answered, refused
from spswap.users import user_and_uid

MAX_LINE_BYTES = 1 << 20
ANSWER_POLL_S = 0.01
CLOSE_WAIT_S = 1.0  # at a stop: how long waiting clients get their own answer first


MAX_SOCKET_PATH_BYTES = 107


def default_socket_path(job_id: str | None, state_dir: Path | None = None) -> Path:
    """``--socket auto``: in ``$XDG_RUNTIME_DIR`` when that is a directory of this user's
    here (sbatch exports the login shell's, which the compute node may not have, or have
    root's), else in the state directory's private ``sock/``, else in
    ``/tmp/spswap-$UID``: the first whose path fits a Unix socket (107 bytes)."""
    name = f"serve-{job_id or os.getpid()}.sock"
    candidates = []
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and _own_writable_dir(Path(xdg)):
        candidates.append(Path(xdg) / name)
    if state_dir is not None:
        candidates.append(Path(os.path.abspath(state_dir)) / "sock" / "serve.sock")
    candidates.append(Path(f"/tmp/spswap-{os.getuid()}") / name)
    for path in candidates:
        if len(os.fsencode(path)) <= MAX_SOCKET_PATH_BYTES:
            return path
    return candidates[-1]


def _own_writable_dir(path: Path) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
            and os.access(path, os.W_OK | os.X_OK))  # fmt: skip


def private_socket_dir(path: Path) -> None:
    """Make the directory of the socket ``path`` (0700) when missing; refuse one that
    another user could write into (they could replace the socket). ``spswap serve`` calls
    it before any model starts, so a bad ``--socket`` costs no cold start."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(path.parent)
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise SpswapError(
            f"{path.parent} is not a private directory of yours (owner uid "
            f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}): another user could take "
            "over the socket; give --socket a path in a directory of yours that only you "
            "may open (mode 0700: `mkdir -m 700 DIR`), or a new one (it is made so)"
        )


def listen_private_socket(path: Path, backlog: int = 64) -> socket.socket:
    """A Unix socket listening at ``path`` (mode 0600) in a private directory of this
    user's (made 0700 when missing; refused when another user could replace the socket).

    Bound and listening under a name of its own first, then renamed into place: a script
    that waits for the socket file and connects at once is never refused (a socket is a
    file from its bind, but takes connections only from its listen)."""
    private_socket_dir(path)
    # short, as it too must fit a socket's path; random, as threads may bind side by side
    staging = path.with_name(f".{secrets.token_hex(3)}")
    if len(os.fsencode(staging)) > MAX_SOCKET_PATH_BYTES:
        staging = path  # a path that fits only as it is: bound there at once
        path.unlink(missing_ok=True)  # (else the rename replaces the old socket)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # 0600: the job's user only
    bound = False
    try:
        sock.bind(str(staging))
        bound = True
        sock.listen(backlog)
        if staging != path:
            os.rename(staging, path)
    except BaseException:
        sock.close()
        if bound and staging != path:  # (only the file this call made)
            staging.unlink(missing_ok=True)
        raise
    finally:
        os.umask(old)
    return sock


class Front:
    """Accepts requests on ``path`` and answers them from ``spool``."""

    def __init__(self, spool: Spool, path: Path) -> None:
        self.spool = spool
        self.path = path
        self._listener: socket.socket | None = None
        self._clients: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._waiting: set[socket.socket] = set()  # clients waiting for an answer
        self._reason = "the server is stopping"

    def open(self) -> None:
        """Bind and listen (again, after a restore); accept in a daemon thread."""
        try:
            self._bind()
        except OSError as e:
            raise SpswapError(
                f"cannot listen on {self.path} ({e.strerror or e}): give --socket a path in "
                "a directory of yours on this node, or --socket auto"
            ) from None

    def _bind(self) -> None:
        sock = listen_private_socket(self.path)
        self._closing.clear()
        self._listener = sock
        threading.Thread(target=self._accept, args=(sock,), daemon=True).start()

    def close(self, reason: str) -> None:
        """Stop admitting: close the listener, tell each waiting client what became of its
        request (its answer when the run gave it meanwhile, else ``reason``: saved for the
        next run), then close every connection."""
        self._reason = reason
        self._closing.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        # each waiting client's own thread answers it (see _answer); give them a moment
        deadline = time.monotonic() + CLOSE_WAIT_S
        while self._waiting and time.monotonic() < deadline:
            time.sleep(ANSWER_POLL_S)
        with self._lock:
            clients, self._clients = self._clients, set()
        for conn in clients:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wake its thread out of recv()
            except OSError:
                pass
            conn.close()

    def _accept(self, listener: socket.socket) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                self._clients.add(conn)
            threading.Thread(target=self._serve_client, args=(conn,), daemon=True).start()

    def _serve_client(self, conn: socket.socket) -> None:
        try:
            for line in _lines(conn):
                with self._lock:
                    self._waiting.add(conn)
                try:
                    _send(conn, self._answer(line))
                finally:
                    with self._lock:
                        self._waiting.discard(conn)
        except OSError:
            pass
        finally:
            with self._lock:
                known = conn in self._clients
                self._clients.discard(conn)
            if known:
                conn.close()

    def _answer(self, line: bytes) -> dict[str, Any]:
        try:
            data = json.loads(line)
            rid = fetch_id(data)  # an id alone: the answer of a request asked before
            if rid is not None:
                self.spool.check_asked(rid)
            else:
                req = Request.from_json(data)
                self.spool.submit(req)
                rid = req.id
        except (ValueError, SpswapError) as e:
            return refused(f"bad request: {e}")
        while True:
            # asked once more after a stop began: an answer given meanwhile is the truth
            closing = self._closing.is_set()
            answer = self.spool.answer(rid)
            if answer is not None:
                return answered(answer)
            if closing:
                break
            time.sleep(ANSWER_POLL_S)
        return not_answered(rid, f"{self._reason} (see the outbox of the state directory)")


def _lines(conn: socket.socket) -> Any:
    buf = b""
    while True:
        chunk = conn.recv(65536)
        if not chunk:
            return
        buf += chunk
        if len(buf) > MAX_LINE_BYTES:
            _send(conn, refused(f"request larger than {MAX_LINE_BYTES} bytes"))
            return
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                yield line


def _send(conn: socket.socket, obj: dict[str, Any]) -> None:
    try:
        conn.sendall(json.dumps(obj).encode() + b"\n")
    except OSError:
        pass


def ask(path: Path, request: dict[str, Any], *, timeout_s: float = 600.0) -> dict[str, Any]:
    """Send one request to a serving job's front and wait for its answer. The id is made
    here when the request has none, so a request the server saved can be asked for again."""
    request = {**request, "id": request.get("id") or uuid.uuid4().hex}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        try:
            sock.connect(str(path))
        except OSError as e:
            raise SpswapError(_connect_error(path, e)) from None
        sock.sendall(json.dumps(request).encode() + b"\n")
        buf = b""
        while b"\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                raise SpswapError(
                    f"{path}: the server closed the connection without an answer; the "
                    f"request may be saved: ask again with --id {request['id']}"
                )
            buf += chunk
        first = buf.split(b"\n", 1)[0]
        try:
            answer: dict[str, Any] = json.loads(first)
        except ValueError:
            raise SpswapError(_not_a_front(path, first)) from None
        if not isinstance(answer, dict):
            raise SpswapError(_not_a_front(path, first))
        answer.setdefault("id", request["id"])
        return answer
    finally:
        sock.close()


def openai_hint(path: Path | str, models: Sequence[str] = ()) -> str:
    """How to ask a multi-model job's OpenAI endpoint at ``path`` (``spswap ask`` cannot):
    a sentence of its own, the command last, naming the first of ``models`` (the job's,
    where known)."""
    which = f" (its models: {', '.join(models)})" if models else ""
    name = models[0] if models else "NAME"
    return (f"Ask it with POST /v1/completions naming the model{which} (docs/multi.md), "
            f"e.g.: curl --unix-socket {path} http://localhost/v1/completions -H "
            f"'content-type: application/json' -d '{{\"model\": \"{name}\", \"prompt\": "
            "[1, 2, 3], \"max_tokens\": 8}'")  # fmt: skip


def _not_a_front(path: Path, first_line: bytes) -> str:
    """What ``spswap ask`` says when ``path`` answers but not as `spswap serve`'s front
    (a multi-model job's OpenAI endpoint answers HTTP)."""
    # (an HTTP server takes a JSON line for an HTTP/0.9 request: its error page comes back)
    if first_line.startswith((b"HTTP/", b"<")):
        return (f"{path} is a multi-model job's OpenAI endpoint (spswap serve --models), "
                f"which spswap ask does not speak. {openai_hint(path)}")  # fmt: skip
    return f"{path} answered something that is not spswap serve's answer: {first_line[:80]!r}"


def _connect_error(path: Path, e: OSError) -> str:
    """Why ``spswap ask`` could not reach ``path``, in the user's terms."""
    if isinstance(e, PermissionError):
        refusal = another_users(path, "a serving job's socket answers its own user only "
                                "(and root); ask a job of yours")  # fmt: skip
        if refusal is not None:
            return refusal
        return (f"{path}: permission denied ({e.strerror or e}); a serving job's socket "
                "answers its own user only (and root)")  # fmt: skip
    if isinstance(e, ConnectionRefusedError):
        return (
            f"nothing listens on {path} any more: the run that opened it has ended "
            "(or is stopped for a preemption); ask again once the job runs"
        )
    return (
        f"no spswap server at {path} ({e.strerror or e}); is the job running? "
        "(`spswap serve --socket` prints where it listens)"
    )


def another_users(path: Path, why: str) -> str | None:
    """``path belongs to another user (name, uid N): why`` when ``path`` (or the nearest
    directory above it that can be seen) is not the caller's, else None."""
    owner = _owner(path)
    if owner is None or owner == os.getuid():
        return None
    return f"{path} belongs to another user ({user_and_uid(owner)}): {why}"


def _owner(path: Path) -> int | None:
    """The uid owning ``path``, or the nearest directory above it that can be seen."""
    for p in (path, *path.parents):
        try:
            return os.stat(p).st_uid
        except PermissionError:
            continue
        except OSError:
            return None
    return None
