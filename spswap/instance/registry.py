"""Where running model instances announce themselves, so ``spswap status`` can list them.

Each serving process keeps one small JSON record at ``$SPSWAP_ROOT/run/instances/<id>.json``
up to date (state, device, job, last reason for a cold start). Plain files: no torch, no
daemon needed to read them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from spswap.fsutil import atomic_write_json, read_json
from spswap.liveness import pid_alive


@dataclass
class InstanceRecord:
    """One model instance as ``spswap status`` shows it."""

    id: str
    model: str
    state: str
    pid: int
    uid: int
    job_id: str | None = None
    device: str = "cpu"
    engine: str = "reference"
    updated: float = field(default_factory=time.time)
    reason: str | None = None  # why the last start was cold, when it was

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> InstanceRecord:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


class InstanceRegistry:
    """The records under one directory (``cfg.paths.run / "instances"``)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def put(self, record: InstanceRecord) -> None:
        record.updated = time.time()
        atomic_write_json(self.directory / f"{record.id}.json", record.to_json())

    def put_best_effort(self, record: InstanceRecord, log: Callable[[str], None]) -> None:
        """:meth:`put`, logging instead of failing: a status record is not worth failing a
        job for (e.g. a root-owned run directory the daemon has not made writable)."""
        try:
            self.put(record)
        except OSError as e:
            log(f"spswap serve: could not update the instance record ({e})")

    def remove(self, instance_id: str) -> None:
        try:
            os.unlink(self.directory / f"{instance_id}.json")
        except FileNotFoundError:
            pass

    def list(self) -> list[tuple[InstanceRecord, bool]]:
        """Every record with whether its process still runs (dead ones are kept: Saved
        instances have no process, and a record of a crash is worth showing)."""
        out: list[tuple[InstanceRecord, bool]] = []
        if not self.directory.is_dir():
            return out
        for path in sorted(self.directory.glob("*.json")):
            data = read_json(path)
            if not isinstance(data, dict):
                continue
            rec = InstanceRecord.from_json(data)
            out.append((rec, pid_alive(rec.pid)))
        return out
