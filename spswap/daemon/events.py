"""The node's append-only event log: one JSON object per line.

The daemon appends; ``spswap events`` and ``spswap status`` read. Each event is one
``write`` on an ``O_APPEND`` descriptor, so concurrent writers never interleave inside
a line; a reader skips a torn (half-written) last line instead of failing.

The log lives on the node's tmpfs, in memory, for as long as the node runs: spswapd's
:class:`EventLog` starts a new file once it reaches :data:`EVENTS_MAX_BYTES`, keeping the
one before as ``events.jsonl.1`` (so at most twice that, whatever the jobs and users of
the node ask); readers read both. So that no user can push everyone else's events out
of both files, each event is at most :data:`MAX_EVENT_BYTES` (long texts cut) and the
events each user's requests make at most :data:`USER_EVENT_BYTES_PER_MIN` (more are
counted, not written, and the count is logged once that user may write again; the
prolog's, the epilog's and spswapd's own events about the user's jobs never count).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TAIL_CHUNK_BYTES = 64 * 1024
EVENTS_MAX_BYTES = 32 << 20  # ~100,000 events a file; two files at most
MAX_EVENT_BYTES = 4096
CUT_TEXT_CHARS = 256  # a text longer than this in an event too large is cut to it
# one user's events (uid != 0): at ~300 bytes an event, 200 a minute: far above what
# jobs make (a few per run), and 32 MiB takes one user over 8 hours
USER_EVENT_BYTES_PER_MIN = 64 * 1024
SUPPRESSED = "events.suppressed"


def rotated(path: Path) -> Path:
    """Where the log's previous file goes when a new one starts."""
    return path.with_name(path.name + ".1")


def make_event(
    kind: str, *, job_id: str | None = None, uid: int | None = None,
    ts: float | None = None, **detail: Any,
) -> dict[str, Any]:  # fmt: skip
    """An event record: ``ts`` (epoch seconds), ``kind``, ``job_id``, ``uid``, ``detail``."""
    return {
        "ts": round(time.time() if ts is None else ts, 6),
        "kind": kind,
        "job_id": job_id,
        "uid": uid,
        "detail": detail,
    }


def format_event(event: dict[str, Any]) -> bytes:
    """The exact line appended for ``event``."""
    return json.dumps(event, separators=(",", ":"), sort_keys=True).encode() + b"\n"


def bounded_line(event: dict[str, Any], max_bytes: int = MAX_EVENT_BYTES) -> bytes:
    """:func:`format_event`, with texts in its detail cut to :data:`CUT_TEXT_CHARS` where
    the line is longer than ``max_bytes`` (and the detail dropped where that is not
    enough). Pure."""
    line = format_event(event)
    if len(line) <= max_bytes:
        return line
    detail = {k: v[:CUT_TEXT_CHARS] + "... (cut)" if isinstance(v, str) and
              len(v) > CUT_TEXT_CHARS else v for k, v in event["detail"].items()}  # fmt: skip
    line = format_event({**event, "detail": {**detail, "cut_from_bytes": len(line)}})
    if len(line) <= max_bytes:
        return line
    return format_event({**event, "detail": {"cut_from_bytes": len(format_event(event))}})


def append(path: Path, kind: str, **fields: Any) -> dict[str, Any]:
    """Append one event to the log at ``path`` (created 0644: users may read it)."""
    event = make_event(kind, **fields)
    _write(path, format_event(event))
    return event


def _write(path: Path, line: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # never through a link (the daemon, as root, appends here)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                 0o644)  # fmt: skip
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class EventLog:
    """spswapd's writer of the log (its only one while it runs): :func:`append`, and a new
    file once the current one holds ``max_bytes`` (thread-safe: the daemon's threads
    append at once, and one rotation must not move another's new file over the old)."""

    def __init__(self, path: Path, max_bytes: int = EVENTS_MAX_BYTES,
                 user_bytes_per_min: int = USER_EVENT_BYTES_PER_MIN,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.path, self.max_bytes = path, max_bytes
        self.user_bytes_per_min = user_bytes_per_min
        self.clock = clock
        self._lock = threading.Lock()
        self._allowance: dict[int, tuple[float, float]] = {}  # uid -> (bytes, when)
        self._suppressed: dict[int, int] = {}  # uid -> events not written

    def append(self, kind: str, *, charge_uid: int | None = None,
               **fields: Any) -> dict[str, Any]:  # fmt: skip
        """Write one event, unless ``charge_uid`` (the user whose request made it; None for
        root's requests and spswapd's own work) is over its allowance: then it is
        counted."""
        event = make_event(kind, **fields)
        line = bounded_line(event)
        uid = charge_uid
        with self._lock:
            if uid:  # (root's, 0, and None are never charged)
                if not self._take(uid, len(line)):
                    self._suppressed[uid] = self._suppressed.get(uid, 0) + 1
                    return event
                if self._suppressed.get(uid):
                    count = self._suppressed.pop(uid)
                    self._write(format_event(make_event(
                        SUPPRESSED, uid=uid, count=count,
                        reason=f"more than {self.user_bytes_per_min} bytes of events of "
                               "this uid in a minute")))  # fmt: skip
            self._write(line)
        return event

    def _take(self, uid: int, size_bytes: int) -> bool:
        """Spend ``size_bytes`` of ``uid``'s allowance (refilled at its rate, up to a
        minute's worth); False when it has not that much."""
        now = self.clock()
        rate = self.user_bytes_per_min
        have, since = self._allowance.get(uid, (float(rate), now))
        have = min(float(rate), have + (now - since) * rate / 60.0)
        if have < size_bytes:
            self._allowance[uid] = (have, now)
            return False
        self._allowance[uid] = (have - size_bytes, now)
        return True

    def _write(self, line: bytes) -> None:
        try:
            full = os.stat(self.path).st_size >= self.max_bytes
        except FileNotFoundError:
            full = False
        if full:
            os.replace(self.path, rotated(self.path))  # the older one goes
        _write(self.path, line)


def parse_lines(data: bytes) -> list[dict[str, Any]]:
    """Events in ``data``; lines that do not parse (a torn write) are skipped."""
    out = []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(obj, dict) and "kind" in obj:
            out.append(obj)
    return out


def tail(path: Path, n: int = 50) -> list[dict[str, Any]]:
    """The last ``n`` events (oldest first), from the log's previous file too where the
    current one has fewer; empty when there is no log yet."""
    latest = _tail_one(path, n)
    if len(latest) < n:
        return _tail_one(rotated(path), n - len(latest)) + latest
    return latest


def _tail_one(path: Path, n: int) -> list[dict[str, Any]]:
    if n <= 0:
        return []
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return []
    with f:
        size = f.seek(0, os.SEEK_END)
        chunk = TAIL_CHUNK_BYTES
        while True:
            start = max(0, size - chunk)
            f.seek(start)
            data = f.read(size - start)
            if start > 0:
                # the first line of the window may be cut: drop it
                data = data[data.find(b"\n") + 1 :]
            events = parse_lines(data)
            if len(events) >= n or start == 0:
                return events[-n:]
            chunk *= 4


def follow(path: Path, *, poll_s: float = 0.2, from_end: bool = True) -> Iterator[dict[str, Any]]:
    """Yield events appended from now on (like ``tail -f``), across a new file started
    meanwhile; stops when the caller stops.

    The starting offset is taken at the call, not at the first ``next()``.
    """
    start: tuple[int | None, int]
    try:
        st = path.stat()
        start = (st.st_ino, st.st_size if from_end else 0)
    except FileNotFoundError:
        start = (None, 0)
    return _follow_from(path, start, poll_s)


def _follow_from(path: Path, start: tuple[int | None, int], poll_s: float
                 ) -> Iterator[dict[str, Any]]:  # fmt: skip
    inode, offset = start
    pending = b""
    while True:
        data = b""
        try:
            with open(path, "rb") as f:
                now = os.fstat(f.fileno()).st_ino
                if inode is not None and now != inode:
                    # a new file: first the rest of the one we read (now the previous)
                    data = _rest_of(rotated(path), inode, offset)
                    offset = 0
                elif f.seek(0, os.SEEK_END) < offset:  # log replaced: start over
                    offset, pending = 0, b""
                inode = now
                f.seek(offset)
                new = f.read()
        except FileNotFoundError:
            new = b""
        offset += len(new)
        pending += data + new
        complete, _, pending = pending.rpartition(b"\n")
        yield from parse_lines(complete)
        time.sleep(poll_s)


def _rest_of(path: Path, inode: int, offset: int) -> bytes:
    """What ``path`` holds past ``offset`` if it is still the file ``inode``."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_ino != inode:
                return b""
            f.seek(offset)
            return f.read()
    except FileNotFoundError:
        return b""
