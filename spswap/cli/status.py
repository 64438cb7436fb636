"""``spswap status``: the node at a glance."""

from __future__ import annotations

from pathlib import Path

from spswap.cli.common import JsonOpt, RootOpt, emit, load_config


def status(json: bool = JsonOpt, root: Path | None = RootOpt) -> None:
    """Show this node's GPUs and their slots, the pool's entries (size, users, last use),
    the model instances and whether the daemon runs. Reads the files under the root: works
    without the daemon, torch or Slurm. Settings come from /etc/default/spswap (or the
    file $SPSWAP_DEFAULTS names), then the environment; settings the node cannot hold are
    warned about, and when spswapd runs with other settings (or GPUs) than these, the
    differences are listed and its GPUs shown."""
    from spswap.status import collect_status, render_status

    data = collect_status(load_config(root))
    emit(data, json, render_status)
