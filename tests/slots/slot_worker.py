"""A real process that reserves and releases slots from a plan (used by the slot tests).

Usage: python slot_worker.py '<json plan>'. Plan: {"dir", "gpus", "log", "name", "poll_s",
"timeout_s", "ops": [{"units"|"whole", "allowed", "hold_s"}], "hold_last_forever"}.
Every grant and release is appended to ``log`` as one JSON line (O_APPEND, one write),
with CLOCK_MONOTONIC times that all processes share: a grant is logged after the table
granted it and a release before the table is told, so each logged interval lies inside
the real one and two logged intervals overlap only if the real ones did.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from spswap.slots.table import SlotTable


def log(fd: int, **event: object) -> None:
    os.write(fd, (json.dumps(event) + "\n").encode())


def main() -> None:
    plan = json.loads(sys.argv[1])
    table = SlotTable(Path(plan["dir"]), plan["gpus"], poll_interval_s=plan.get("poll_s", 0.005))
    fd = os.open(plan["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    ops = plan["ops"]
    for i, op in enumerate(ops):
        final = plan.get("hold_last_forever", False) and i == len(ops) - 1
        r = table.reserve(
            model=f"{plan['name']}-{i}",
            units=op.get("units", 4),
            whole_gpus=op.get("whole"),
            allowed_gpus=op.get("allowed"),
            timeout_s=plan.get("timeout_s", 60.0),
        )
        log(
            fd, ev="grant", w=plan["name"], rid=r.id, ticket=int(r.id[1:]),
            keys=sorted(r.unit_keys()), cands=op.get("allowed") or plan["gpus"],
            granted_at=r.granted_at, t=time.monotonic_ns(), final=final,
        )  # fmt: skip
        if final:
            while True:
                time.sleep(3600)  # held until the test kills this process
        time.sleep(op.get("hold_s", 0.0))
        log(fd, ev="release", w=plan["name"], rid=r.id, t=time.monotonic_ns())
        table.release(r.id)


if __name__ == "__main__":
    main()
