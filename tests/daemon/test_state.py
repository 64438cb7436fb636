"""The daemon object owns its in-memory state: nothing lives in module globals, so two
daemons (or two tests) in one process share none of it."""

from __future__ import annotations

from pathlib import Path

from spswap.config import Config
from spswap.daemon.state import DaemonState


def test_two_daemon_states_share_nothing(tmp_path: Path) -> None:
    cfg = Config.from_env({}, root=tmp_path / "root")
    a, b = DaemonState(cfg), DaemonState(cfg)
    assert a.kept is not b.kept and a.dumping is not b.dumping
    assert a.job_locks.of("7") is a.job_locks.of("7")
    assert a.job_locks.of("7") is not b.job_locks.of("7")
    a.dumping.hold("7", "digest-a")
    assert a.dumping.digests() == [("7", "digest-a")] and b.dumping.digests() == []
    a.dumping.end("7")
    assert a.dumping.digests() == []
    assert a.statuses.path("7") == cfg.paths.run / "checkpoints" / "7.json"
