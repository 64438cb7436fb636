"""Fixtures: a short, world-traversable temp root and a real spswapd serving it."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spswap.config import Config
from spswap.daemon import lifecycle, prewake
from spswap.daemon.kept import Kept
from spswap.daemon.state import DaemonState
from spswap.daemon.statuses import CheckpointState
from spswap.fsutil import atomic_write_json
from tests.uids import node_root

REPO = Path(__file__).resolve().parents[2]


def console_entry() -> tuple[str, str]:
    """The ``spswap`` console script's (module, function), as pyproject.toml names it
    (read with a pattern: tomllib is not in Python 3.10)."""
    text = (REPO / "pyproject.toml").read_text()
    found = re.search(r'^\[project\.scripts\]\n(?:.*\n)*?spswap\s*=\s*"([\w.]+):(\w+)"', text, re.M)
    assert found, 'no spswap = "module:function" under [project.scripts] in pyproject.toml'
    return found[1], found[2]


# What the installed `spswap` console script runs (pip writes this very call), on this
# checkout's code however (or whether) it is installed, and from any working directory
# (slurmd's is /): `node prolog` as argv serves `spswap node prolog`, minus typer (see
# spswap.cli.main).
_MODULE, _FUNC = console_entry()
# (the path in double quotes: test_prolog puts the code in single quotes for a shell)
ENTRY_CALL = (f"import sys; sys.path.insert(0, {json.dumps(str(REPO))}); "
              f"from {_MODULE} import {_FUNC}; sys.exit({_FUNC}())")  # fmt: skip
FAST_SPSWAP = [sys.executable, "-c", ENTRY_CALL]


@pytest.fixture
def cfg() -> Iterator[Config]:
    with node_root("spsd-") as cfg:
        yield cfg


@pytest.fixture
def daemon(cfg: Config) -> Iterator[int]:
    """The pid of a real spswapd (a detached subprocess) serving ``cfg``'s root."""
    yield lifecycle.start(cfg, wait_s=15.0)


def exchange(
    cfg: Config, data: bytes, *, close_write: bool = True, timeout_s: float = 15.0
) -> bytes:
    """Send raw bytes to the daemon and read until it closes (or, with close_write, EOF)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    s.connect(str(cfg.paths.socket))
    try:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon may hang up before reading everything (oversized)
        if close_write:
            s.shutdown(socket.SHUT_WR)
        out = bytearray()
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        return bytes(out)
    finally:
        s.close()


def prolog_env(cfg: Config, job_id: str, uid: int = 0, user: str = "root") -> dict[str, str]:
    """What slurmd gives a prolog: the job's variables and no PATH."""
    return {
        "SPSWAP_ROOT": str(cfg.root), "SLURM_JOB_ID": job_id, "SLURM_JOB_UID": str(uid),
        "SLURM_JOB_USER": user, "SLURM_JOB_GPUS": "0", "CUDA_VISIBLE_DEVICES": "0",
        "SLURM_JOB_RESTART_COUNT": "0", "SLURMD_NODENAME": "gpu07",
    }  # fmt: skip


def which_spswap() -> str:
    return shutil.which("spswap") or str(Path(sys.executable).parent / "spswap")


class Parking:
    """The parked cgroups' calls, recorded (the real ones: tests/checkpoint/)."""

    def __init__(self, pid: int, calls: list[str]) -> None:
        self._pids = {pid}
        self.calls = calls

    def pids(self) -> set[int]:
        return set(self._pids)

    def thaw(self) -> bool:
        self.calls.append("thaw")
        return True

    def freeze(self) -> bool:
        self.calls.append("freeze")
        return True

    def kill_all(self) -> list[int]:
        self.calls.append("kill")
        killed, self._pids = sorted(self._pids), set()
        return killed

    def remove(self) -> None:
        self.calls.append("remove")


@pytest.fixture
def kept7(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Job 7's kept tree (a real ``sleep`` process, its parked cgroups' and CUDA calls
    recorded) in a real daemon state: (state, kept, calls, gpus, events); ``gpus["now"]``
    is what the job's GPUs read as."""
    cfg = Config.from_env({}, root=tmp_path / "root")
    lifecycle.prepare_dirs(cfg)
    st = DaemonState(cfg)
    proc = subprocess.Popen(["sleep", "300"])
    calls: list[str] = []
    image = cfg.paths.images / "job-7-img"
    image.mkdir(parents=True)
    atomic_write_json(image / "spswap-cuda.json", {"cuda_pids": [proc.pid],
                                                   "gpu_uuids": ["GPU-a"]})  # fmt: skip
    st.statuses.write("7", state=CheckpointState.SAVED, pid=proc.pid, key=image.name, kept=True)
    kept = Kept("7", proc.pid, None, Parking(proc.pid, calls), image.name, 0.0)
    st.kept.add(kept)
    gpus = {"now": ["GPU-a"]}
    monkeypatch.setattr(prewake, "run_gpu_uuids", lambda st, job_id: gpus["now"])

    def wake_kept(image: Path, pid: int, **kw: Any) -> dict[str, float]:
        calls.append(f"cuda_restore unlock={kw['unlock']}")
        assert kw["tree"] == {proc.pid}
        return {"cuda_restore": 0.5}

    monkeypatch.setattr(prewake, "wake_kept", wake_kept)
    events: list[tuple[str, dict[str, Any]]] = []
    real_event = st.event

    def event(kind: str, **fields: Any) -> None:
        events.append((kind, fields))
        real_event(kind, **fields)

    monkeypatch.setattr(st, "event", event)
    monkeypatch.setattr(st.kept, "_event", event)  # it holds the daemon's own
    yield st, kept, calls, gpus, events
    proc.kill()
    proc.wait()
