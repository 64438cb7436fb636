"""What the GPU tests that dump a real vLLM server share: what they need (root, CRIU >=
4.1, the CUDA checkpoint, io_uring off: vLLM's process holds one), a stand-in job's
environment, and the waits with the logs that say why one timed out."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def criu_ready() -> str | None:
    """Why the checkpoint path of the real server cannot run here, or None."""
    from spswap.checkpoint import criu, cuda_ckpt

    if os.geteuid() != 0:
        return "CRIU dumps need root"
    path = criu.find_criu()
    if path is None or criu.criu_version(path) < criu.MIN_VERSION:
        return "needs CRIU >= 4.1 (scripts/build_criu.sh, or SPSWAP_CRIU=.criu-build/bundle/criu)"
    if not cuda_ckpt.available():
        return f"no CUDA checkpoint: {cuda_ckpt.unavailable_reason()}"
    sysctl = Path("/proc/sys/kernel/io_uring_disabled")
    if not sysctl.exists() or sysctl.read_text().strip() != "2":
        return "needs sysctl kernel.io_uring_disabled=2 (vLLM's process holds an io_uring)"
    return None


def job_env(root: Path, job: str, restart: int) -> dict[str, str]:
    """The environment of a stand-in job's run ``restart`` of ``job`` on spswap root
    ``root`` (none of this process's own Slurm variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SPSWAP_ROOT=str(root), SLURM_JOB_ID=job, SLURM_RESTART_COUNT=str(restart))
    return env


def wait_logged(what: str, check: Callable[[], Any], timeout_s: float, logs: Path) -> Any:
    """``check()``'s first true value, polled; on time out the end of each ``run*.log``
    in ``logs`` goes into the failure."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: " + "".join(
            p.read_text()[-3000:] for p in logs.glob("run*.log")
        )
        time.sleep(0.2)
    return value


def wait_saved(cfg: Any, job: str, logs: Path, timeout_s: float = 300) -> dict[str, Any]:
    """The job's checkpoint status once its dump ended; a failed dump fails the test with
    its reason, run 0's log and CRIU's own logs."""
    import pytest

    from spswap.daemon.client import Client

    status: dict[str, Any] = wait_logged("the dump", lambda: (
        st if (st := Client(cfg).call("checkpoint.status", job_id=job))["state"]
        not in ("none", "dumping") else None), timeout_s, logs)  # fmt: skip
    if status["state"] != "saved":
        dumps = "".join(f"\n--- {p}\n" + p.read_text()[-6000:]
                        for p in cfg.root.rglob("*.log") if "dump" in p.name)  # fmt: skip
        pytest.fail(f"dump failed: {json.dumps(status, indent=1)}\n--- run0.log\n"
                    f"{(logs / 'run0.log').read_text()[-3000:]}{dumps}")  # fmt: skip
    return status
