"""Settings that cannot hold on this node (issue 15 item 11): a pool or an images' budget
larger than the file system it lives on, a keep budget larger than the node's memory.

The daemon logs them at start (and ``settings.unfit`` in the event log), ``spswap daemon
start``, ``spswap status`` and ``spswap doctor`` show them: each message names the
setting, the numbers and the fix. They are warnings, not refusals: a prolog must never
fail for spswap's own trouble, and a node with a daemon that warns still serves its jobs
(the pool evicts, then refuses an import that does not fit, with the sizes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spswap.config import Config
from spswap.fsutil import fs_sizes
from spswap.units import fmt_bytes


@dataclass(frozen=True)
class NodeSizes:
    """What the settings must fit in; None where it could not be read."""

    fs_bytes: int | None
    """Size of the file system holding the root (the tmpfs)."""
    fs_path: str
    mem_total_bytes: int | None


def unfit_settings(cfg: Config, sizes: NodeSizes) -> list[str]:
    """Why ``cfg`` cannot hold on a node of ``sizes``, one message a setting. Pure."""
    out: list[str] = []
    pool = cfg.pool_capacity_bytes
    if pool is not None and sizes.fs_bytes and pool > sizes.fs_bytes:
        out.append(
            f"SPSWAP_POOL_CAPACITY_BYTES={fmt_bytes(pool)} is more than the "
            f"{fmt_bytes(sizes.fs_bytes)} file system that holds {sizes.fs_path}: imports "
            f"would fail with 'no space left' before the pool is full. Set it to at most "
            f"{fmt_bytes(sizes.fs_bytes * 0.8)}, or leave it out (80% of the file system), "
            f"or give the tmpfs more room (mount -o remount,size=...)"
        )  # fmt: skip
    out += _share_over("SPSWAP_POOL_USER_BYTES", cfg.pool_user_bytes,
                       "SPSWAP_POOL_CAPACITY_BYTES", pool, "imports",
                       "the pool's capacity")  # fmt: skip
    images = cfg.images_bytes
    if images is not None and sizes.fs_bytes and images > sizes.fs_bytes:
        out.append(
            f"SPSWAP_IMAGES_BYTES={fmt_bytes(images)} is more than the "
            f"{fmt_bytes(sizes.fs_bytes)} file system that holds {sizes.fs_path}: dumps "
            f"would find it full first. Set it to at most {fmt_bytes(sizes.fs_bytes // 2)} "
            f"beside the pool, or leave it out (half of the file system)"
        )  # fmt: skip
    out += _share_over("SPSWAP_IMAGES_USER_BYTES", cfg.images_user_bytes,
                       "SPSWAP_IMAGES_BYTES", images, "images", "all images' budget")  # fmt: skip
    keep = cfg.keep_bytes
    if keep is not None and sizes.mem_total_bytes and keep > sizes.mem_total_bytes:
        out.append(
            f"SPSWAP_KEEP_BYTES={fmt_bytes(keep)} is more than this node's "
            f"{fmt_bytes(sizes.mem_total_bytes)} of memory: kept instances would take the "
            f"memory the jobs need. Set it well below (the default is 1/8: "
            f"{fmt_bytes(sizes.mem_total_bytes // 8)}), or 0 to keep none"
        )  # fmt: skip
    return out


def crowded_budgets(cfg: Config, pool_bytes: int, images_bytes: int,
                    sizes: NodeSizes) -> str | None:  # fmt: skip
    """Why the pool (``pool_bytes``) and the images (``images_bytes``) cannot both be full
    on the root's file system: they add up to more than it (the defaults, 80% and half of
    it, always do); None where they fit or its size is unknown. A dump that finds no room
    is refused and its job's next run starts from the pool: nothing is lost but the
    checkpoint. Pure."""
    total = pool_bytes + images_bytes
    if not sizes.fs_bytes or total <= sizes.fs_bytes:
        return None
    pool_how = "" if cfg.pool_capacity_bytes is not None else ", the default 80%"
    images_how = "" if cfg.images_bytes is not None else ", the default half"
    return (
        f"the pool ({fmt_bytes(pool_bytes)}{pool_how}) and the images "
        f"({fmt_bytes(images_bytes)}{images_how}) may take {fmt_bytes(total)} together, more "
        f"than the {fmt_bytes(sizes.fs_bytes)} file system that holds {sizes.fs_path}: with "
        f"the pool full a dump can find no room (it is refused, and the job's next run "
        f"starts from the pool). Set SPSWAP_POOL_CAPACITY_BYTES and SPSWAP_IMAGES_BYTES to "
        f"add up to at most {fmt_bytes(sizes.fs_bytes)}, or give the root a tmpfs of its own "
        f'of at least {fmt_bytes(total)} (docs/slurm.md, "The root\'s tmpfs in huge pages")'
    )


def _share_over(name: str, share: int | None, whole_name: str, whole: int | None,
                what: str, bound: str) -> list[str]:  # fmt: skip
    """The message of one user's share set above the whole it is a share of, if it is."""
    if share is None or whole is None or share <= whole:
        return []
    return [f"{name}={fmt_bytes(share)} is more than {whole_name}={fmt_bytes(whole)}: one "
            f"user's {what} are bounded by {bound} anyway. Set it lower (its default is half "
            f"of {whole_name})"]  # fmt: skip


def node_sizes(cfg: Config, meminfo: Path = Path("/proc/meminfo")) -> NodeSizes:
    """The file system holding ``cfg.root`` (its nearest existing folder) and MemTotal."""
    try:
        fs_bytes: int | None = fs_sizes(cfg.root)[0]
    except OSError:
        fs_bytes = None
    mem: int | None = None
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return NodeSizes(fs_bytes=fs_bytes, fs_path=str(cfg.root), mem_total_bytes=mem)


def settings_problems(cfg: Config) -> list[str]:
    """:func:`unfit_settings` on this node."""
    return unfit_settings(cfg, node_sizes(cfg))


def settings_differences(here: dict[str, Any], daemon: dict[str, Any]) -> list[str]:
    """One line per setting the daemon runs with other than this command's. Pure."""
    missing = object()  # a setting the other side's spswap does not know (another version)
    return [f"{name}: {_setting_text(name, here.get(name, missing), missing)} here, "
            f"{_setting_text(name, daemon.get(name, missing), missing)} in spswapd"
            for name in sorted(set(here) | set(daemon))
            if here.get(name, missing) != daemon.get(name, missing)]  # fmt: skip


def _setting_text(name: str, value: Any, missing: object) -> str:
    """A setting's value as the settings file would say it (unset: the default; a size
    in units, as one writes it there)."""
    if value is missing:
        return "not known (another spswap version)"
    if value is None:
        return "the default"
    if isinstance(value, bool):  # (before int: a bool is one) as the file writes it
        return "1" if value else "0"
    if isinstance(value, list):
        return ",".join(map(str, value))
    if name.endswith("_BYTES") and isinstance(value, int) and value:
        return fmt_bytes(value)
    return str(value)


def restart_hint(file: str | None, command: str = "spswap") -> str:
    """What to do when the running spswapd's settings are not this shell's; ``file``: the
    settings file spswapd read; ``command``: how to run spswap (:func:`spswap_command`).
    Pure."""
    return (f"spswapd reads {file or 'its settings file'} when it starts: to apply an edit, "
            "restart it as root (`systemctl restart spswapd` where its systemd unit runs "
            f"it, else `{command} daemon stop; {command} daemon start`; instances kept "
            "alive are ended then, their images stay); a SPSWAP_* variable of this shell's "
            "environment is this shell's alone")  # fmt: skip


def spswap_command() -> str:
    """``spswap`` where the shell's PATH finds it, else the path of the one running (root's
    shell in a checkout often has none on its PATH)."""
    import shutil
    import sys

    if shutil.which("spswap"):
        return "spswap"
    argv0 = Path(sys.argv[0])
    return str(argv0.resolve()) if argv0.name == "spswap" and argv0.exists() else "spswap"
