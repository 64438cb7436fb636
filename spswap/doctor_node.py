"""``spswap doctor``'s rows about spswap's own state on the node: the root's file system
(tmpfs), the state tree's ownership, the daemon and the settings it runs with, the
settings file and what of it cannot hold, keeping dumped instances alive, CRIU's
restore in huge pages and the root's tmpfs in huge pages."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from spswap.config import Config
from spswap.daemon import lifecycle
from spswap.daemon.client import Client
from spswap.daemon.image_room import ImageRoom
from spswap.daemon.trust import unsafe_dir
from spswap.doctor_check import check
from spswap.errors import DaemonError
from spswap.fsutil import existing_parent, fs_sizes
from spswap.pool.store import Pool
from spswap.settings_check import (
    NodeSizes,
    crowded_budgets,
    restart_hint,
    settings_differences,
    spswap_command,
)
from spswap.settings_file import read_settings_file, settings_file_path
from spswap.units import fmt_bytes


def _unescape_mount(field: str) -> str:
    """A /proc/mounts field as the path it names (the kernel writes a space, tab, newline
    and backslash as octal escapes: ``\\040``, ``\\011``, ``\\012``, ``\\134``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_entry(path: Path, mounts_text: str) -> tuple[str, str, str] | None:
    """``(mount point, fs type, options)`` of the mount holding ``path``, from
    ``/proc/mounts`` text: of two mounts on one point the later, which hides the other.
    Pure."""
    best: tuple[str, str, str] | None = None
    target = str(path)
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = _unescape_mount(parts[1])
        inside = target == point or target.startswith(point.rstrip("/") + "/") or point == "/"
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, parts[2], parts[3] if len(parts) > 3 else "")
    return best


def storage(cfg: Config) -> list[dict[str, Any]]:
    """The file system under the root: a tmpfs (pool and images at memory speed), and
    whether it holds its files in huge pages (:func:`root_huge_check`)."""
    probe = existing_parent(cfg.root)
    size, free = fs_sizes(probe)
    try:
        found = mount_entry(probe.resolve(), Path("/proc/mounts").read_text())
    except OSError:
        found = None
    try:
        shmem = thp_mode(SHMEM_ENABLED.read_text())
    except OSError:
        shmem = None
    huge = root_huge_check(str(cfg.root), found, shmem, gpu_node=Path("/dev/nvidiactl").exists())
    fstype = found[1] if found else "unknown"
    value = f"{fstype} at {found[0] if found else probe}: {fmt_bytes(size)}, {fmt_bytes(free)} free"
    if fstype == "tmpfs":
        return [check(f"storage ({cfg.root})", True, value, required=True), huge]
    return [check(
        f"storage ({cfg.root})", None, value,
        "not tmpfs: pool and images are slower; set SPSWAP_ROOT to a tmpfs such as "
        "/dev/shm/spswap (on a GPU node one of its own: docs/slurm.md, \"The root's tmpfs in "
        "huge pages\")",
    ), huge]  # fmt: skip


def budgets(cfg: Config, problems: list[str], sizes: NodeSizes) -> dict[str, Any]:
    """What the pool and the images may hold on this node, all together and each user's
    (the settings, or their defaults from the file system's size); ``problems``: the
    settings that cannot hold here (:func:`settings`' too), which make it a warning, as
    do budgets (set or default) that add up to more than the file system (``sizes``)."""
    pool = Pool.from_config(cfg)
    images = ImageRoom.from_config(cfg).limits()
    try:
        value = budgets_text(pool.capacity_bytes, pool.user_bytes, images.total_bytes,
                             images.user_bytes)  # fmt: skip
        crowded = crowded_budgets(cfg, pool.capacity_bytes, images.total_bytes, sizes)
    except OSError as e:
        return check("budgets", None, f"cannot read the file system under {cfg.root}: {e}")
    if problems:  # (the re-walk: "ok ... pool 1000.0 TiB" beside the settings FAIL)
        return check("budgets", None, value, "not all of it can hold here: see the settings row")
    if crowded is not None:
        return check("budgets", None, value, crowded)
    return check("budgets", True, value)


def budgets_text(pool_bytes: int, pool_user_bytes: int, images_bytes: int,
                 images_user_bytes: int) -> str:  # fmt: skip
    """The budgets row's value. Pure.

    >>> budgets_text(16 << 30, 8 << 30, 10 << 30, 5 << 30)
    "pool 16.0 GiB, each user's imports 8.0 GiB; images 10.0 GiB, each user's 5.0 GiB"
    """
    return (
        f"pool {fmt_bytes(pool_bytes)}, each user's imports {fmt_bytes(pool_user_bytes)}; "
        f"images {fmt_bytes(images_bytes)}, each user's {fmt_bytes(images_user_bytes)}"
    )


def daemon(cfg: Config) -> dict[str, Any]:
    """Whether spswapd runs, and with the settings this shell reads (it reads its file
    when it starts: an edit since needs a restart)."""
    pid = lifecycle.daemon_running(cfg)
    path = lifecycle.pid_path(cfg)
    if pid is None:
        return check(
            "daemon",
            None,
            "not running",
            f"no live daemon holds {path}; the Slurm prolog starts it",
        )
    shown = f"pid {pid}" if pid > 0 else "starting" if os.geteuid() == 0 else "running"
    try:  # the settings it runs with, which it read when it started
        theirs = Client(cfg, timeout_s=2.0).call("status")
    except DaemonError:
        return check("daemon", True, shown)
    differs = settings_differences(cfg.to_json(), theirs.get("settings") or {})
    if differs:
        file = theirs.get("settings_file")
        return check(
            "daemon",
            None,
            f"{shown}, with other settings than this shell reads: " + "; ".join(differs),
            restart_hint(file if isinstance(file, str) else None, spswap_command()),
        )
    return check("daemon", True, shown)


def root_ownership(cfg: Config) -> dict[str, Any]:
    """The state tree must be root's alone (spswapd refuses it otherwise)."""
    if not os.path.lexists(cfg.root):
        return check("state tree", None, f"{cfg.root} does not exist yet",
                     "spswapd makes it at its first start (the Slurm prolog, or `spswap daemon "
                     "start` as root); if the daemon runs, SPSWAP_ROOT or --root here names "
                     "another root than its own")  # fmt: skip
    p = cfg.paths
    problems = [why for d in (cfg.root, p.run, p.log, p.images, p.pool)
                if (why := unsafe_dir(d))]  # fmt: skip
    if problems:
        return check("state tree", False, "; ".join(problems),
                     f"remove {cfg.root} (spswapd recreates it) or fix the owner and mode",
                     required=True)  # fmt: skip
    return check("state tree", True, f"{cfg.root}: root's, not writable by others")


def keep_check(budget_bytes: int, can_park: bool | None, mem_total_bytes: int | None = None,
               on_gpu: bool = False) -> dict[str, Any]:  # fmt: skip
    """Whether dumped instances can be kept alive (frozen, parked) for their job's next
    run: a keep budget and parked cgroups are both needed (``can_park`` None: not
    checked, the caller is not root), and a budget the node's memory can hold.
    ``on_gpu``: SPSWAP_KEEP_ON_GPU is on (their GPU state waits on their GPU). Pure."""
    name = "keep dumped instances"
    slower = "each swap back to a dumped job then runs CRIU's restore (about 2 s more)"
    if budget_bytes <= 0:
        if on_gpu:
            return check(name, None, "off (SPSWAP_KEEP_BYTES=0); SPSWAP_KEEP_ON_GPU=1 has "
                         "nothing to keep", "set SPSWAP_KEEP_BYTES above 0, or drop "
                         f"SPSWAP_KEEP_ON_GPU; {slower}")  # fmt: skip
        return check(name, None, "off (SPSWAP_KEEP_BYTES=0)", slower)
    if mem_total_bytes and budget_bytes > mem_total_bytes:
        return check(name, None, f"up to {fmt_bytes(budget_bytes)} (SPSWAP_KEEP_BYTES): more "
                     f"than this node's {fmt_bytes(mem_total_bytes)} of memory",
                     "see the settings row")  # fmt: skip
    where = (", their sleeping GPU state left on their GPU where CUDA checkpoint works "
             "(SPSWAP_KEEP_ON_GPU=1: held outside any slot until another job reserves "
             "there)") if on_gpu else ""  # fmt: skip
    if can_park is None:
        return check(name, None, f"up to {fmt_bytes(budget_bytes)} (SPSWAP_KEEP_BYTES) where "
                     f"parked cgroups can be made{where}: not checked (needs root)",
                     "run `sudo spswap doctor` for the node's answer")  # fmt: skip
    if not can_park:
        return check(name, None, "no: needs parked cgroups (see 'dump outside the job')",
                     slower)  # fmt: skip
    return check(name, True, f"up to {fmt_bytes(budget_bytes)} (SPSWAP_KEEP_BYTES), frozen "
                 f"in parked cgroups{where}")  # fmt: skip


THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
THP_FILL_PATCH = "thp-fill.patch"


def thp_mode(text: str | None) -> str | None:
    """The chosen word of ``transparent_hugepage/enabled`` (``always [madvise] never`` ->
    ``madvise``); None where there is none (no THP in the kernel). Pure."""
    for word in (text or "").split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def hugepages_check(on: bool, criu_path: str | None, criu_patches: frozenset[str] | None,
                    thp: str | None) -> dict[str, Any]:  # fmt: skip
    """Whether CRIU's restore fills in huge pages (SPSWAP_RESTORE_HUGEPAGES): the setting,
    the CRIU (``criu_patches``: its build stamp's patch names, None where no stamp) and
    the kernel's THP mode (``thp``). Information, not required. Pure."""
    name = "restore huge pages"
    mode = f"THP {thp}" if thp else "no THP in this kernel"
    if not on:
        hint = {
            "madvise": ": SPSWAP_RESTORE_HUGEPAGES=1 may restore faster (measure first: "
            "docs/benchmarks.md)",
            "always": ": the kernel may fill in huge pages already",
        }.get(thp or "", "")
        return check(name, True, f"off: CRIU's own fill ({mode}){hint}")
    if criu_path is None:
        return check(name, False, "SPSWAP_RESTORE_HUGEPAGES=1, but no CRIU found",
                     "see the criu row")  # fmt: skip
    if THP_FILL_PATCH not in (criu_patches or ()):
        return check(name, False, f"SPSWAP_RESTORE_HUGEPAGES=1, but {criu_path} has no spswap "
                     "thp-fill patch", "rebuild it with scripts/build_criu.sh (as root), "
                     "which applies it; until then the setting does nothing")  # fmt: skip
    if thp in (None, "never"):
        return check(name, False, f"SPSWAP_RESTORE_HUGEPAGES=1, but {mode}",
                     "the setting does nothing: set /sys/kernel/mm/transparent_hugepage/"
                     "enabled to madvise, or remove the setting")  # fmt: skip
    return check(name, True, f"on ({mode}; {criu_path} has spswap's thp-fill patch)")


ROOT_HUGE_FIX = (
    "mount a tmpfs of its own at SPSWAP_ROOT with huge=within_size: faster CUDA restores "
    '(docs/slurm.md, "The root\'s tmpfs in huge pages")'
)


def root_huge_check(root: str, mount: tuple[str, str, str] | None, shmem: str | None,
                    gpu_node: bool = True) -> dict[str, Any]:  # fmt: skip
    """Whether the root's tmpfs keeps its files in huge pages (its mount's ``huge=``,
    ``mount`` as :func:`mount_entry` gives it; ``shmem``: the chosen word of
    ``transparent_hugepage/shmem_enabled``, which can deny or force it). A job's pool
    entry is pinned for the GPU's copies page by page, at the first wake and again at
    every CUDA restore: on a node without a GPU (``gpu_node`` False) it does not matter.
    Information, not required. Pure."""
    name = "root huge pages"
    fix = ROOT_HUGE_FIX
    if mount is None or mount[1] != "tmpfs":
        where, huge_pages = f"{root} is not on a tmpfs (see the storage row)", False
    else:
        point, _fstype, options = mount
        huge = next((o.split("=", 1)[1] for o in options.split(",")
                     if o.startswith("huge=")), "never")  # fmt: skip
        where = f"tmpfs at {point}, huge={huge}"
        if shmem == "deny":
            where, huge_pages = f"{where}, but shmem_enabled is deny", False
            fix = f"set {SHMEM_ENABLED} to never (it then follows the mount)"
        elif shmem == "force":
            where, huge_pages = f"{where}; shmem_enabled force", True
        else:
            huge_pages = huge in ("within_size", "always")
        where += ": 2 MiB pages" if huge_pages else ": 4 KiB pages"
    if huge_pages:
        return check(name, True, where)
    if not gpu_node:
        return check(name, True, f"{where} (no GPU here: they matter for GPU copies only)")
    return check(name, None, where, fix)


def settings(problems: list[str]) -> dict[str, Any]:
    """Where the settings came from (the file every command and the daemon read) and
    what of them cannot hold on this node (``problems``, from
    :func:`~spswap.settings_check.unfit_settings`)."""
    read = read_settings_file(settings_file_path(os.environ))
    source = (f"{read.path}, then the environment" if read.exists and not read.problem
              else f"environment only ({read.problem or f'no {read.path}'})")  # fmt: skip
    return check("settings", False if problems else True, source, "; ".join(problems))
