"""The node's append-only event log: one JSON object per line.

The daemon appends; ``spswap events`` and ``spswap status`` read. Each event is one
``write`` on an ``O_APPEND`` descriptor, so concurrent writers never interleave inside
a line; a reader skips a torn (half-written) last line instead of failing.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TAIL_CHUNK_BYTES = 64 * 1024


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


def append(path: Path, kind: str, **fields: Any) -> dict[str, Any]:
    """Append one event to the log at ``path`` (created 0644: users may read it)."""
    event = make_event(kind, **fields)
    path.parent.mkdir(parents=True, exist_ok=True)
    # never through a link (the daemon, as root, appends here)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                 0o644)  # fmt: skip
    try:
        os.write(fd, format_event(event))
    finally:
        os.close(fd)
    return event


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
    """The last ``n`` events (oldest first); empty when there is no log yet."""
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
    """Yield events appended from now on (like ``tail -f``); stops when the caller stops.

    The starting offset is taken at the call, not at the first ``next()``.
    """
    offset = path.stat().st_size if (from_end and path.exists()) else 0
    return _follow_from(path, offset, poll_s)


def _follow_from(path: Path, offset: int, poll_s: float) -> Iterator[dict[str, Any]]:
    pending = b""
    while True:
        try:
            with open(path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                if size < offset:  # log replaced: start over
                    offset, pending = 0, b""
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            data = b""
        offset += len(data)
        pending += data
        complete, _, pending = pending.rpartition(b"\n")
        yield from parse_lines(complete)
        time.sleep(poll_s)
