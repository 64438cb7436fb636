"""Fixtures: a short, world-traversable temp root and a real spswapd serving it."""

from __future__ import annotations

import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from spswap.config import Config
from spswap.daemon import lifecycle
from tests.uids import node_root

# A process whose first two argv items are "node prolog" served as `spswap node prolog`
# is, minus typer (see spswap.node.main).
FAST_SPSWAP = [sys.executable, "-c", "import spswap.node as n; n.main()"]


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
