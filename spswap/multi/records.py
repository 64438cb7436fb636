"""A multi-model job's rows in ``spswap status``: one instance record per model, its state
(up or asleep) kept current by the router, all removed when the job's run ends."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from spswap.instance.registry import InstanceRecord, InstanceRegistry
from spswap.instance.state import State


class ModelRecords:
    """The records of one run's models (through spswapd where a user may not write)."""

    def __init__(self, instances_dir: Path, *, job_id: str | None, engine: str, device: str,
                 log: Callable[[str], None]) -> None:  # fmt: skip
        self.registry = InstanceRegistry(instances_dir)
        self.job_id, self.engine, self.device, self.log = job_id, engine, device, log
        self._written: set[str] = set()

    def record_id(self, model: str) -> str:
        """``<job>-<pid>-<model>``: unique per run and model, as serve's are per run (a
        character an instance id may not hold becomes ``_``)."""
        return re.sub(r"[^A-Za-z0-9._-]", "_", f"{self.job_id or 'local'}-{os.getpid()}-{model}")

    def update(self, model: str, awake: bool) -> None:
        """The model is up (awake) or asleep now."""
        self.mark(model, (State.UP if awake else State.SLEEP).value)

    def mark(self, model: str, state: str) -> None:
        """The model's row says ``state`` (e.g. "checkpoint" while the job is parked)."""
        record = InstanceRecord(id=self.record_id(model), model=model, state=state,
                                pid=os.getpid(), uid=os.getuid(), job_id=self.job_id,
                                device=self.device, engine=self.engine)  # fmt: skip
        self.registry.put_best_effort(record, self.log)
        self._written.add(record.id)

    def remove_all(self) -> None:
        """The run is over: its rows go (never raises; a stale row is shown as gone)."""
        for record_id in sorted(self._written):
            self.registry.remove(record_id)
        self._written.clear()
