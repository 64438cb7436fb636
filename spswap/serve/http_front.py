"""An opt-in, authenticated TCP front for the vLLM server's private Unix socket.

``spswap serve --engine vllm --port N`` listens on ``--host`` (default 127.0.0.1) and
forwards OpenAI API requests to the server's socket. Every request must carry
``Authorization: Bearer <key>``, the job's key (a random token in ``STATE_DIR/api_key``,
mode 0600): other users of the node reach the port but not the key. Only the OpenAI
paths are forwarded (:data:`ALLOWED_PREFIXES`); vLLM's development endpoints (``/sleep``,
``/wake_up``, ``/collective_rpc``, ...) answer 403 here and stay on the private socket.

One request per connection: the request's head is checked, its body (``Content-Length``
only) forwarded, the answer piped back as it comes (streamed completions included), then
both connections close. Until a connection has shown the key it is "unproven", and
unproven connections are capped per kind of peer (:func:`peer_kind`, the owner of a
loopback peer read from /proc/net/tcp; :func:`admit`): other users of the node get
:data:`FOREIGN_MAX_CONNECTIONS`, remote peers :data:`REMOTE_MAX_UNPROVEN`, and when theirs
are all taken a new one ends the oldest of the peer (user on this node, else address)
that holds the most (:func:`to_evict`): idle connections, which cannot hold the key, can
neither lock out the job's own clients nor remote clients that send their request at
once. Connections past the key check share :data:`MAX_CONNECTIONS`. Pure parts
(:func:`parse_head`, :func:`refusal`, :func:`upstream_head`, :func:`admit`,
:func:`to_evict`) are tested on
their exact output.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import os
import re
import secrets
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from spswap.checkpoint import proctree
from spswap.errors import BadHttpRequest

ALLOWED_PREFIXES = ("/v1/", "/health", "/ping", "/version", "/tokenize", "/detokenize",
                    "/metrics")  # fmt: skip
# not forwarded: hop-by-hop headers, and the key (vLLM has no use for it)
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "transfer-encoding", "upgrade",
                        "authorization"})  # fmt: skip
MAX_HEAD_BYTES = 64 << 10
HEAD_TIMEOUT_S = 30.0  # a client that sends no request head in this time is dropped
MAX_CONNECTIONS = 256  # the job owner's unproven ones, and all that showed the key
# other users on this node cannot hold the key: their connections get a small share, so
# they cannot take the job owner's by opening idle ones
FOREIGN_MAX_CONNECTIONS = 16
REMOTE_MAX_UNPROVEN = 64  # peers off this node (--host other than loopback)
MAX_CLASSIFYING = 64  # new connections whose peer's user is being read from /proc
MAX_BODY_BYTES = 64 << 20
PIPE_CHUNK_BYTES = 64 << 10


@dataclass(frozen=True)
class Head:
    """A request line and its headers (names lower-cased; the last of repeats wins)."""

    method: str
    target: str
    version: str
    headers: dict[str, str]


_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 token: a header name


def parse_head(raw: bytes) -> Head:
    """Parse an HTTP/1.x request head (without the final blank line)."""
    try:
        text = raw.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        raise BadHttpRequest("undecodable request head") from None
    # A bare LF, CR or NUL inside a line could make the server behind see a second,
    # unchecked request: refuse every control character (tab in values aside).
    lines = text.split("\r\n")
    if any(ord(c) < 32 and c != "\t" or c == "\x7f" for line in lines for c in line):
        raise BadHttpRequest("control characters in the request head")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadHttpRequest(f"not an HTTP/1.x request line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name):
            raise BadHttpRequest(f"malformed header line {line[:80]!r}")
        headers[name.lower()] = value.strip()
    return Head(parts[0], parts[1], parts[2], headers)


def refusal(head: Head, key: str) -> tuple[int, str] | None:
    """Why ``head`` is not forwarded, as (status, message); None to forward it."""
    auth = head.headers.get("authorization", "")
    given = auth[7:] if auth.startswith("Bearer ") else ""
    if not hmac.compare_digest(given.encode(), key.encode()):
        return 401, ("missing or wrong API key: send 'Authorization: Bearer <key>' with the "
                     "key in the job's STATE_DIR/api_key")  # fmt: skip
    path = head.target.split("?", 1)[0]
    if not path.startswith("/") or ".." in path.split("/"):
        return 400, "the request target must be an absolute path"
    # "/v1/" is a prefix; the others are exact paths ("/healthz" is not "/health")
    if not any(path.startswith(p) if p.endswith("/") else path == p for p in ALLOWED_PREFIXES):
        return 403, (f"{path} is not served on this port (only the OpenAI API: "
                     f"{', '.join(ALLOWED_PREFIXES)})")  # fmt: skip
    if "chunked" in head.headers.get("transfer-encoding", "").lower():
        return 411, "send the request body with a Content-Length (chunked is not accepted)"
    length = head.headers.get("content-length", "0")
    if not (length.isascii() and length.isdigit()):
        return 400, f"bad Content-Length {length!r}"
    if int(length) > MAX_BODY_BYTES:
        return 413, f"request body over {MAX_BODY_BYTES} bytes"
    return None


def upstream_head(head: Head) -> bytes:
    """The head sent to the vLLM socket: hop-by-hop headers and the API key dropped,
    ``Connection: close`` added (one request per connection)."""
    lines = [f"{head.method} {head.target} HTTP/1.1"]
    lines += [f"{k}: {v}" for k, v in head.headers.items() if k not in HOP_BY_HOP]
    lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def error_response(status: int, message: str) -> bytes:
    """A small JSON error answer that closes the connection."""
    reasons = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 411: "Length Required",
               413: "Payload Too Large", 502: "Bad Gateway",
               503: "Service Unavailable"}  # fmt: skip
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    head = (f"HTTP/1.1 {status} {reasons.get(status, 'Error')}\r\ncontent-type: application/json"
            f"\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n")  # fmt: skip
    return head.encode() + body


def new_key(path: Path) -> str:
    """A fresh API key written to ``path`` (mode 0600, created exclusively)."""
    import os

    key = secrets.token_urlsafe(32)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def peer_kind(host: str, peer_uid: int | None, own_uid: int, local_host: str = "") -> str:
    """``own`` (this node, the job's user), ``foreign`` (this node, another user, or an
    owner not found) or ``remote`` (another host: its user cannot be known). A peer on
    this node's own address (``local_host``, the listening side's) is this node too."""
    if not is_loopback(host) and host != local_host:
        return "remote"
    return "own" if peer_uid == own_uid else "foreign"


def is_loopback(host: str) -> bool:
    """A loopback address (IPv4-mapped and scoped IPv6 forms included)."""
    addr = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def to_evict(groups: list[str]) -> int:
    """Which unproven connection to end for a new one, given each one's peer group
    (oldest first): the oldest of the group that holds the most, so a peer that opens
    many idle connections ends its own, not those of other peers."""
    from collections import Counter

    biggest = Counter(groups).most_common(1)[0][0]
    return groups.index(biggest)


def admit(kind: str, unproven: int) -> str:
    """What a new connection of ``kind`` gets while ``unproven`` of its kind have not
    shown the key: ``"take"``; ``"evict"`` (end the oldest unproven one of that kind
    first: a client that sends its request at once always gets a turn); or ``"refuse"``
    (the job owner's own connections are never ended for another)."""
    cap = {"own": MAX_CONNECTIONS, "foreign": FOREIGN_MAX_CONNECTIONS}.get(
        kind, REMOTE_MAX_UNPROVEN
    )
    if unproven < cap:
        return "take"
    return "refuse" if kind == "own" else "evict"


def port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now (another process holds it, the address
    is not this node's), or None: asked before a first run loads its model, so a taken
    port fails the job at once rather than after the model's minutes of loading."""
    try:
        family, kind, proto, _name, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM)[0]  # fmt: skip
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the front listens
            s.bind(address)
    except OSError as e:
        return f"{host}:{port} cannot be listened on ({e.strerror or e})"
    return None


class HttpFront:
    """Serves ``host:port`` in a thread of its own; forwards to the Unix socket ``uds``."""

    def __init__(self, uds: Path, key: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.uds, self.key, self.host, self.port = uds, key, host, port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        # per kind of peer, the connections that have not shown the key (with the peer's
        # group, see _peer), oldest first
        self._unproven: dict[str, dict[asyncio.StreamWriter, str]] = {
            "own": {},
            "foreign": {},
            "remote": {},
        }
        self._proven: set[asyncio.StreamWriter] = set()
        self._classifying = 0  # connections whose peer is being looked up

    def start(self) -> int:
        """Listen and serve; returns the port (useful with port 0)."""
        self._thread = threading.Thread(target=self._run, name="spswap-http-front", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self.port

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(self._handle, self.host, self.port)
            )
            self.port = self._server.sockets[0].getsockname()[1]
        except BaseException as e:  # reported by start()
            self._error = e
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    def stop_accepting(self) -> None:
        """Stop listening; forwarded requests run on (see :meth:`active`)."""
        loop, server = self._loop, self._server
        if loop is not None and server is not None:
            loop.call_soon_threadsafe(server.close)

    def active(self) -> int:
        """Connections being served now."""
        return len(self._writers)

    def stop(self) -> None:
        """Stop listening and end every forwarded connection."""
        loop, server = self._loop, self._server
        if loop is None or server is None:
            return

        async def shutdown() -> None:
            server.close()
            # abort, not close: a client that stopped reading must not keep its socket
            # open (a dump cannot take a connection to an outside peer)
            for w in list(self._writers):
                w.transport.abort()
            for task in asyncio.all_tasks(loop):
                if task is not asyncio.current_task():
                    task.cancel()
            await asyncio.sleep(0)

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._classifying >= MAX_CLASSIFYING:  # a flood of new connections: shed them
            writer.transport.abort()
            return
        self._classifying += 1
        try:
            kind, group = await self._peer(writer)
        except asyncio.CancelledError:  # the front stops: the connection must not outlive it
            writer.transport.abort()
            raise
        except Exception:  # noqa: BLE001 - an unknown peer is ended, the front serves on
            writer.transport.abort()
            return
        finally:
            self._classifying -= 1
        unproven = self._unproven[kind]
        verdict = admit(kind, len(unproven))
        if verdict == "refuse":
            writer.transport.abort()
            return
        if verdict == "evict":
            held = list(unproven.items())
            victim = held[to_evict([g for _, g in held])][0]
            del unproven[victim]
            victim.transport.abort()
        unproven[writer] = group
        self._writers.add(writer)
        try:
            await self._forward(reader, writer, kind)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                TimeoutError):  # fmt: skip
            pass
        finally:
            unproven.pop(writer, None)
            self._proven.discard(writer)
            self._writers.discard(writer)
            writer.close()

    async def _peer(self, writer: asyncio.StreamWriter) -> tuple[str, str]:
        """The peer's kind (:func:`peer_kind`) and group (its user on this node, else its
        address): who an eviction is charged to (:func:`to_evict`)."""
        peer, local = writer.get_extra_info("peername"), writer.get_extra_info("sockname")
        if not peer or not local:
            return "foreign", "unknown"
        if peer_kind(peer[0], None, -1, local[0]) == "remote":
            return "remote", f"ip:{peer[0]}"  # no /proc read: its user cannot be known
        uid = await asyncio.get_running_loop().run_in_executor(
            None, proctree.tcp_peer_uid, tuple(peer[:2]), tuple(local[:2])
        )  # /proc read: off the loop
        return peer_kind(peer[0], uid, os.getuid(), local[0]), f"uid:{uid}"

    async def _forward(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, kind: str
    ) -> None:
        try:
            raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
        except asyncio.LimitOverrunError:
            writer.write(error_response(400, "request head too large"))
            return
        if len(raw) > MAX_HEAD_BYTES:
            writer.write(error_response(400, "request head too large"))
            return
        try:
            head = parse_head(raw[:-4])
        except BadHttpRequest as e:
            writer.write(error_response(400, str(e)))
            return
        refused = refusal(head, self.key)
        if refused is not None:
            writer.write(error_response(*refused))
            await writer.drain()
            return
        if writer not in self._unproven[kind]:
            return  # ended for a newer connection while its head came in
        del self._unproven[kind][writer]
        if len(self._proven) >= MAX_CONNECTIONS:
            writer.write(error_response(503, f"over {MAX_CONNECTIONS} requests at once: retry"))
            return
        self._proven.add(writer)
        body = await reader.readexactly(int(head.headers.get("content-length", "0")))
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(str(self.uds))
        except OSError as e:
            writer.write(
                error_response(
                    502,
                    f"the model server is not reachable ({e}); it "
                    "may be restarting after a preemption: retry",
                )
            )
            return
        try:
            up_writer.write(upstream_head(head) + body)
            await up_writer.drain()
            while chunk := await up_reader.read(PIPE_CHUNK_BYTES):
                writer.write(chunk)
                await writer.drain()
        finally:
            up_writer.close()
