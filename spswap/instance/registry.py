"""Where running model instances announce themselves, so ``spswap status`` can list them.

Each serving process keeps one small JSON record at ``$SPSWAP_ROOT/run/instances/<id>.json``
up to date (state, device, job, last reason for a cold start). Plain files: no torch, no
daemon needed to read them. ``run/`` is root's: a user's process, which may not write
there, has spswapd write its record (``instance.put``, with the caller's uid and pid as
the kernel tells them).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from spswap.config import Config
from spswap.daemon.client import Client
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


_NOT_OURS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT)
"""Errors of a direct write that mean "not this process's folder": ask the daemon."""


class InstanceRegistry:
    """The records under one directory (``cfg.paths.instances``, so the daemon's
    socket is ``../spswapd.sock`` beside it)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def put(self, record: InstanceRecord) -> None:
        record.updated = time.time()
        atomic_write_json(self.directory / f"{record.id}.json", record.to_json())

    def put_best_effort(self, record: InstanceRecord, log: Callable[[str], None]) -> None:
        """:meth:`put`, through spswapd where this process may not write the folder (a
        user's, under root's ``run/``); logging instead of failing: a status record is not
        worth failing a job for."""
        try:
            self.put(record)
            return
        except OSError as e:
            if e.errno not in _NOT_OURS:
                log(f"spswap serve: could not update the instance record ({e})")
                return
        try:
            self._daemon_call("instance.put", record=record.to_json())
        except Exception as e:  # a status record must never end the run
            log(f"spswap serve: could not update the instance record through spswapd ({e})")

    def remove(self, instance_id: str) -> None:
        """Drop the record (through spswapd when this process may not); never raises."""
        try:
            os.unlink(self.directory / f"{instance_id}.json")
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno not in _NOT_OURS:
                return
            try:
                self._daemon_call("instance.remove", id=instance_id)
            except Exception:
                pass  # the next `spswap status` shows it as gone (its process is)

    def drop_dead_of_job(self, job_id: str) -> list[str]:
        """Unlink the records of job ``job_id`` whose process is gone (for spswapd, once
        the job will not come back to this node: its saved instance is no more, and
        `spswap status` listed such records for ever); the ids dropped. Live records stay."""
        dropped = []
        for rec, alive in self.list():
            if rec.job_id == job_id and not alive:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.directory / f"{rec.id}.json")
                dropped.append(rec.id)
        return dropped

    def _daemon_call(self, op: str, **args: Any) -> Any:
        root = self.directory.parent.parent  # <root>/run/instances
        return Client(Config.from_env({}, root=root), timeout_s=5.0).call(op, **args)

    def list(self) -> list[tuple[InstanceRecord, bool]]:
        """Every record with whether its process still runs (dead ones are kept: Saved
        instances have no process, and a record of a crash is worth showing, until
        spswapd finds their job will not come back: :meth:`drop_dead_of_job`)."""
        out: list[tuple[InstanceRecord, bool]] = []
        if not self.directory.is_dir():
            return out
        for path in sorted(self.directory.glob("*.json")):
            data = read_json(path)
            if not isinstance(data, dict):
                continue
            try:
                rec = InstanceRecord.from_json(data)
                alive = pid_alive(int(rec.pid))
            except (TypeError, ValueError):  # not a record: one bad file hides no other
                continue
            out.append((rec, alive))
        return out
