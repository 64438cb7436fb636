"""The running test cluster and a polling helper, shared by the Slurm tests."""

from __future__ import annotations

import contextlib
import pwd
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLURM_UP = REPO / "scripts" / "slurm_up.sh"
DEFAULTS_FILE = Path("/etc/default/spswap")


@dataclass
class SlurmCluster:
    """The running test cluster: 2 fake GPUs, partitions debug, low (preemptable), high."""

    work: Path
    spswap_root: Path
    spswap_bin: str
    grace_time_s: int
    proctrack: str = "linuxproc"  # "cgroup": spswapd parks a dumped tree outside its job

    def sbatch(self, script: str, *args: str) -> str:
        """Submit ``script`` (bash body) with ``args``; returns the job id."""
        path = self.work / f"job{time.monotonic_ns()}.sh"
        path.write_text("#!/bin/bash\n" + script + "\n")
        proc = subprocess.run(
            ["sbatch", "--parsable", f"--chdir={self.work}", f"--output={self.work}/%j.out",
             *args, str(path)],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        return proc.stdout.strip().split(";")[0]

    def node_state(self) -> str:
        """The node's state (sinfo prints it once per partition)."""
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=10
        )
        return " ".join(sorted(set(out.stdout.split())))

    def hook_log(self, action: str) -> str:
        path = self.spswap_root / "log" / f"{action}.log"
        return path.read_text() if path.exists() else ""


def as_user(uid: int) -> list[str]:
    """The ``setpriv`` prefix that runs a command as ``uid`` with its own groups."""
    return ["setpriv", f"--reuid={uid}", f"--regid={pwd.getpwuid(uid).pw_gid}", "--init-groups"]


@dataclass
class UserShell:
    """A normal user's commands on the test node, as a user's login shell runs them: the
    cluster's spswap on PATH, the user's HOME and name, the node's SPSWAP_ROOT."""

    cluster: SlurmCluster
    uid: int
    home: Path  # also the working directory

    def env(self) -> dict[str, str]:
        return {"PATH": f"{Path(self.cluster.spswap_bin).parent}:/usr/bin:/bin",
                "HOME": str(self.home), "USER": pwd.getpwuid(self.uid).pw_name,
                "SPSWAP_ROOT": str(self.cluster.spswap_root)}  # fmt: skip

    def run(self, *argv: str, timeout_s: float = 180.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*as_user(self.uid), *argv], env=self.env(), cwd=self.home,
                              capture_output=True, text=True, timeout=timeout_s)  # fmt: skip


def wait_for(what: str, check: Callable[[], object], timeout_s: float = 30.0,
             detail: Callable[[], str] | None = None) -> object:  # fmt: skip
    """Poll ``check`` until it returns something truthy; fail naming ``what`` (and, with
    ``detail``, what it returns then: e.g. the job's log, for a failure seen only in CI)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            more = f"\n{detail()}" if detail is not None else ""
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}{more}")
        time.sleep(0.2)


@contextlib.contextmanager
def node_setting(cluster: SlurmCluster, line: str) -> Iterator[None]:
    """``line`` added to the node's settings file for a while; spswapd stopped at both
    ends, so the next prolog starts one that reads the file as it is then."""
    from spswap.config import Config
    from spswap.daemon.lifecycle import stop

    before = DEFAULTS_FILE.read_text()
    DEFAULTS_FILE.write_text(before + line + "\n")
    stop(Config.from_env({}, root=cluster.spswap_root))
    try:
        yield
    finally:
        DEFAULTS_FILE.write_text(before)
        stop(Config.from_env({}, root=cluster.spswap_root))
