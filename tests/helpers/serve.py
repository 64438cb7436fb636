"""The command line the tests run ``spswap serve`` with on the CPU (reference engine)."""

from __future__ import annotations

import sys
from pathlib import Path


def cpu_serve_argv(model: Path, state_dir: Path, *extra: str) -> list[str]:
    """``spswap serve MODEL --state-dir STATE --device cpu EXTRA...`` on this interpreter
    and this checkout's code."""
    return [sys.executable, "-m", "spswap.cli", "serve", str(model), "--state-dir",
            str(state_dir), "--device", "cpu", *extra]  # fmt: skip
