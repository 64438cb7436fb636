"""``spswap events``: the node's event log (job starts and ends, releases, daemon starts)."""

from __future__ import annotations

import json as jsonlib
import time
from pathlib import Path
from typing import Any

import typer
from rich.table import Table
from rich.text import Text

from spswap.cli.common import JsonOpt, RootOpt, console, emit_json, load_config
from spswap.daemon import events as log
from spswap.plain import plain_row
from spswap.units import fmt_bytes


def _when(ts: float, *, year: bool = True) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S" if year else "%m-%d %H:%M:%S", time.localtime(ts))


DETAIL_ERROR_LINES = 2


DETAIL_LIST_ITEMS = 6


DIGEST_SHOWN_CHARS = 12  # as `spswap pool ls` shows a digest; --json has all 64


def _is_digest(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def short_value(value: Any, sep: str = "\n") -> str:
    """A detail value as shown: a many-line one (a failed checkpoint's reason carries
    CRIU's log) cut to its first line and its first error lines, with a count of the rest;
    an object (a saved image's report) as its plain fields, sizes in bytes made readable,
    with a count of the nested ones left out; a list as its plain items, a long one cut
    with a count; a pool digest as its first 12 characters (``spswap pool ls``'s)."""
    if isinstance(value, dict):
        return _short_object(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):  # plain items, no Python quotes (a 64-hex digest cut)
        items = [short_value(v, sep) if isinstance(v, str) else str(v) for v in value]
        if len(items) > DETAIL_LIST_ITEMS:
            shown = ",".join(items[:DETAIL_LIST_ITEMS])
            return f"[{shown},...] (+{len(items) - DETAIL_LIST_ITEMS} more)"
        return "[" + ",".join(items) + "]"
    if isinstance(value, str) and _is_digest(value):
        return value[:DIGEST_SHOWN_CHARS]
    lines = [line for line in str(value).splitlines() if line.strip()]
    if len(lines) <= 1 + DETAIL_ERROR_LINES:
        return sep.join(lines)
    errors = [line.strip() for line in lines[1:] if "rror" in line][:DETAIL_ERROR_LINES]
    rest = len(lines) - 1 - len(errors)
    return sep.join([lines[0], *errors, f"(+{rest} more lines: spswap events --json)"])


def _size_pair(key: str, value: Any) -> str | None:
    """``key=value`` for a byte count (a key ending in ``_bytes``), the size made readable
    and the suffix dropped; None for anything else."""
    if key.endswith("_bytes") and isinstance(value, int | float) and not isinstance(value, bool):
        return f"{key.removesuffix('_bytes')}={fmt_bytes(value)}"
    return None


def _short_object(value: dict[str, Any]) -> str:
    plain: list[str] = []
    nested = 0
    for k, v in sorted(value.items()):
        if k.endswith("bytes_by_kind") and isinstance(v, dict):
            # an image's memory by kind (checkpoint.layout): the kinds it holds, largest first
            held = sorted(((n, kind) for kind, n in v.items() if n), reverse=True)
            plain.extend(f"{kind.replace(' ', '_')}={fmt_bytes(n)}" for n, kind in held)
        elif isinstance(v, dict | list):
            nested += 1 if v else 0
        elif (size := _size_pair(k, v)) is not None:
            plain.append(size)
        elif isinstance(v, float):
            plain.append(f"{k}={v:.4g}")
        elif isinstance(v, str) and _is_digest(v):
            plain.append(f"{k}={v[:DIGEST_SHOWN_CHARS]}")
        else:
            plain.append(f"{k}={str(v).splitlines()[0] if str(v) else ''}")
    more = [f"(+{nested} more: spswap events --json)"] if nested else []
    return "{" + " ".join(plain + more) + "}"


def _details(event: dict[str, Any], sep: str) -> str:
    items = sorted((event.get("detail") or {}).items())
    return " ".join(_size_pair(k, v) or f"{k}={short_value(v, sep)}" for k, v in items)


def event_line(event: dict[str, Any]) -> str:
    """One event as a plain line: time, kind, job, uid, details as key=value."""
    detail = _details(event, " | ")
    job = event.get("job_id") or "-"
    uid = event.get("uid")
    return f"{_when(float(event.get('ts', 0)))}  {event.get('kind', '?'):<14} job={job} " + (
        f"uid={'-' if uid is None else uid} {detail}".rstrip()
    )


def events_table(events: list[dict[str, Any]]) -> Table:
    table = Table(title="events", title_justify="left")
    for col in ("time", "kind", "job", "uid"):
        table.add_column(col, no_wrap=True)
    table.add_column("detail", overflow="fold")  # wrapped, never cut (a pipe is 80 wide)
    for e in events:
        detail = _details(e, "\n")
        uid = e.get("uid")
        plain_row(table, _when(float(e.get("ts", 0)), year=False), str(e.get("kind")),
                      e.get("job_id") or "-",
                      "-" if uid is None else str(uid), Text(detail))  # fmt: skip
    return table


def events(
    n: int = typer.Option(50, "-n", "--lines", min=0, help="How many of the latest events."),
    json: bool = JsonOpt,
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new events."),
    root: Path | None = RootOpt,
) -> None:
    """Show the node's event log ($SPSWAP_ROOT/log/events.jsonl, written by spswapd):
    job starts and ends, reservation releases, checkpoints (saved, kept, what an image
    holds: checkpoint.layout), kept instances (kept.ended; kept.on_gpu, kept.not_on_gpu
    and kept.off_gpu with SPSWAP_KEEP_ON_GPU), restores, daemon starts and stops. Reads the file
    directly, so it works while the daemon is down. In a terminal: a table; piped (or with
    --follow): one line per event, for grep. Pool digests show their first 12 characters
    (as `spswap pool ls`) and long details are shortened; --json has everything: a JSON
    list (or, with --follow, one JSON object per line)."""
    cfg = load_config(root)
    latest = log.tail(cfg.paths.events, n)
    if json and not follow:
        emit_json(latest)
        return
    if json:
        for e in latest:
            print(jsonlib.dumps(e, sort_keys=True), flush=True)
    elif not latest and not follow:
        console.print(f"no events yet in {cfg.paths.events}", markup=False)
        return
    elif follow or not console.is_terminal:
        for e in latest:
            console.print(event_line(e), markup=False, soft_wrap=True)
    else:
        console.print(events_table(latest))
    if follow:
        try:
            for e in log.follow(cfg.paths.events):
                if json:
                    print(jsonlib.dumps(e, sort_keys=True), flush=True)
                else:
                    console.print(event_line(e), markup=False, soft_wrap=True)
        except KeyboardInterrupt:
            pass
