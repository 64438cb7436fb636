#!/usr/bin/env python3
"""The user flow's restore as a timeline: spswapd's events of the requeued job (and the
high job's end) in seconds after the high job's end, with the steps' own timings.

    spswap events -n 200 --json | python3 scripts/gpu/flow_timeline.py JOB HIGH_END_TS \
        [SERVING_TS FIRST_ANSWER_TS]

Prints one JSON object: {"timeline": [[offset_s, job, kind, timings], ...]}, the
timings being each event's ``timings_s`` (a restore's CRIU and CUDA steps) where it
has one. Used by scripts/gpu/user_flow.sh (its "FLOW timeline" line).
"""

from __future__ import annotations

import json
import sys
from typing import Any

# the events of a restore's path, in the order they come
KINDS = ("job.end", "job.start", "job.starting", "slots.reserve", "restore.restored_early",
         "restore.woken_early", "restore.joined_job", "restore.done")  # fmt: skip


def _timings(detail: dict[str, Any]) -> dict[str, float]:
    found = detail.get("timings_s") or {}
    return {k: round(float(v), 3) for k, v in found.items() if "_pid" not in k}


def timeline(events: list[dict[str, Any]], job: str, t0: float,
             marks: dict[str, float]) -> list[list[Any]]:  # fmt: skip
    """The job's restore events (and every job's end) from ``t0`` on, with ``marks``
    (name -> epoch seconds) among them, as [offset_s, job, kind, timings] rows."""
    rows: list[list[Any]] = []
    for e in events:
        if e.get("kind") not in KINDS or e.get("ts", 0) < t0 - 0.5:
            continue
        if e["kind"] != "job.end" and e.get("job_id") != job:
            continue
        rows.append([round(e["ts"] - t0, 3), e.get("job_id"), e["kind"],
                     _timings(e.get("detail") or {})])  # fmt: skip
    rows += [[round(ts - t0, 3), job, name, {}] for name, ts in marks.items()]
    return sorted(rows, key=lambda r: r[0])


def main(argv: list[str]) -> int:
    job, t0 = argv[1], float(argv[2])
    marks = {}
    if len(argv) > 4:
        marks = {"serving (seen by the client)": float(argv[3]), "first answer": float(argv[4])}
    events = json.load(sys.stdin)
    print(json.dumps({"timeline": timeline(events, job, t0, marks)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
