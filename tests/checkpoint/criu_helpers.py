"""Helpers for the CRIU tests: a real counting server process, and a way to talk to it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spswap.checkpoint import criu

SERVER = Path(__file__).with_name("counter_server.py")


def criu_skip_reason() -> str | None:
    """Why the real-CRIU tests cannot run here, or None when they can."""
    path = criu.find_criu()
    if path is None:
        return "no criu found: run scripts/build_criu.sh"
    try:
        version = criu.criu_version(path)
    except Exception as e:  # noqa: BLE001 - any failure means: cannot run here
        return f"{path} unusable: {e}"
    if version < criu.MIN_VERSION:
        return f"{path} is CRIU {version}, need >= 4.1: run scripts/build_criu.sh"
    if os.geteuid() != 0:
        return "CRIU dumps need root"
    ok, out = criu.criu_check(path)
    if not ok:
        return f"criu check failed: {out[-300:]}"
    return None


needs_criu = pytest.mark.skipif((reason := criu_skip_reason()) is not None, reason=reason or "")


def ask(sock_path: Path, cmd: bytes = b"next", timeout_s: float = 5.0) -> str:
    """One request to the counter server; returns its answer line."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(str(sock_path))
        s.sendall(cmd)
        return s.recv(256).decode().strip()


class Server:
    """A counter server started in its own session (setsid), as an engine would be."""

    def __init__(self, workdir: Path, *extra: str) -> None:
        self.sock = workdir / "counter.sock"
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER), str(self.sock), *extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, cwd=workdir,
        )  # fmt: skip
        self.pid = self.proc.pid
        ready = Path(str(self.sock) + ".ready")
        deadline = time.monotonic() + 20
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"counter server did not start (exit {self.proc.poll()})")
            time.sleep(0.02)

    def ask(self, cmd: bytes = b"next") -> str:
        return ask(self.sock, cmd)

    def kill(self, pid: int | None = None) -> None:
        try:
            os.kill(pid or self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pass
