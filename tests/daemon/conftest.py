"""Fixtures: a short, world-traversable temp root and a real spswapd serving it."""

from __future__ import annotations

import json
import re
import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from spswap.config import Config
from spswap.daemon import lifecycle
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
