"""``spswap status``: the node at a glance."""

from __future__ import annotations

from pathlib import Path

from spswap.cli.common import JsonOpt, RootOpt, emit, load_config


def status(json: bool = JsonOpt, root: Path | None = RootOpt) -> None:
    """Show this node's GPUs and their slots, the pool's entries (size, users, last use),
    the model instances and whether the daemon runs. Reads the files under the root: works
    without the daemon, torch or Slurm."""
    from spswap.status import collect_status, render_status

    data = collect_status(load_config(root))
    emit(data, json, render_status)
