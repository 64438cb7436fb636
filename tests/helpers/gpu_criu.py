"""What the GPU tests that dump a real vLLM server need: root, CRIU >= 4.1, the CUDA
checkpoint and io_uring off (vLLM's process holds one)."""

from __future__ import annotations

import os
from pathlib import Path


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
