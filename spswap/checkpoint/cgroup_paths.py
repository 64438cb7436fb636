"""Where a process's cgroups are: the parsing of /proc/<pid>/cgroup and
/proc/self/mountinfo (pure, tested on exact text), and the directories they name.

Split from :mod:`spswap.checkpoint.cgroups` (which re-exports these names): parking a
tree needs to know where the tree and spswapd are in each hierarchy Slurm tracks jobs by.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TRACKING = ("", "freezer")  # the hierarchies proctrack/cgroup signals a job through


@dataclass(frozen=True)
class Membership:
    """One line of /proc/<pid>/cgroup: ``controllers`` is "" for cgroup v2."""

    controllers: str
    path: str


def parse_proc_cgroup(text: str) -> list[Membership]:
    """``4:memory:/a/b`` lines -> memberships (v2's ``0::/x`` has no controllers)."""
    out = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[2].startswith("/"):
            out.append(Membership(parts[1], parts[2]))
    return out


@dataclass(frozen=True)
class Mount:
    """A mounted cgroup hierarchy: where it is and which part of it (``root``)."""

    controllers: str
    root: str
    mountpoint: str


def parse_mountinfo(text: str) -> list[Mount]:
    """The cgroup and cgroup2 mounts of a /proc/<pid>/mountinfo. A v1 mount's controllers
    are the super options that name one (``rw,cpu,cpuacct`` -> ``cpu,cpuacct``)."""
    mounts = []
    for line in text.splitlines():
        pre, sep, post = line.partition(" - ")
        if not sep:
            continue
        fields, tail = pre.split(), post.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, mountpoint = fields[3], fields[4].replace("\\040", " ")
        if tail[0] == "cgroup2":
            mounts.append(Mount("", root, mountpoint))
        elif tail[0] == "cgroup":
            opts = [o for o in tail[2].split(",") if o not in ("rw", "ro")]
            names = [o for o in opts if o.startswith("name=") or "=" not in o]
            mounts.append(Mount(",".join(n for n in names if n not in _MOUNT_FLAGS), root,
                                mountpoint))  # fmt: skip
    return mounts


# v1 super options that are flags, not controllers
_MOUNT_FLAGS = {"noprefix", "clone_children", "xattr", "cpuset_v2_mode", "nsdelegate",
                "favordynmods", "memory_recursiveprot", "memory_localevents"}  # fmt: skip


def fs_path(m: Membership, mounts: list[Mount]) -> Path | None:
    """Where membership ``m``'s cgroup is in the file system, None when not mounted."""
    want = set(m.controllers.split(",")) if m.controllers else set()
    for mount in mounts:
        have = set(mount.controllers.split(",")) if mount.controllers else set()
        if have != want:
            continue
        root = mount.root.rstrip("/")
        if m.path == root or m.path.startswith(root + "/"):
            return Path(mount.mountpoint) / m.path[len(root) :].lstrip("/")
    return None


def memberships(pid: int | str, proc: Path = PROC) -> list[Membership]:
    try:
        return parse_proc_cgroup((proc / str(pid) / "cgroup").read_text())
    except OSError:
        return []


def mounts(proc: Path = PROC) -> list[Mount]:
    """This process's cgroup mounts (raises OSError when mountinfo cannot be read)."""
    return parse_mountinfo((proc / "self" / "mountinfo").read_text())


def own_dirs(found: list[Mount], proc: Path = PROC) -> dict[str, Path]:
    """This process's own cgroup directory in each hierarchy Slurm tracks jobs by
    (:data:`TRACKING`): where parked cgroups are made, probed and swept."""
    return {m.controllers: d for m in memberships("self", proc)
            if m.controllers in TRACKING and (d := fs_path(m, found)) is not None}  # fmt: skip


def in_job(found: list[Membership], job_id: str) -> bool:
    """Whether a process of ``found`` memberships runs inside Slurm job ``job_id``'s
    cgroup, in a hierarchy Slurm tracks jobs by (proctrack/cgroup names it ``job_<id>``:
    ``.../slurmstepd.scope/job_<id>/step_batch/...`` on v2, ``/slurm/uid_<uid>/job_<id>/...``
    in v1's freezer), by the names alone (see :func:`in_slurm_job` for the check that a
    user cannot make pass). Pure."""
    return bool(job_memberships(found, job_id))


def job_memberships(found: list[Membership], job_id: str) -> list[Membership]:
    """Of ``found``, the tracking hierarchies' memberships cut at their ``job_<id>``
    component (the job's own cgroup, not its step's). Pure."""
    name, out = f"job_{job_id}", []
    for m in found:
        parts = m.path.split("/")
        if m.controllers in TRACKING and name in parts:
            out.append(Membership(m.controllers, "/".join(parts[: parts.index(name) + 1])))
    return out


def in_slurm_job(found: list[Membership], job_id: str, mounts_found: list[Mount]) -> bool:
    """:func:`in_job`, where the ``job_<id>`` cgroup and every folder above it up to its
    mount are root's: Slurm makes them as root, while a user with a delegated cgroup
    (systemd's user@.service) can make a folder of that name under their own."""
    for m in job_memberships(found, job_id):
        d = fs_path(m, mounts_found)
        mount = next((Path(x.mountpoint) for x in mounts_found
                      if d is not None and d.is_relative_to(x.mountpoint)), None)  # fmt: skip
        if d is None or mount is None:
            continue
        try:
            if all(os.lstat(x).st_uid == 0 for x in (d, *d.parents) if x.is_relative_to(mount)):
                return True
        except OSError:
            continue
    return False


def job_dirs(job_id: str, found: list[Mount], *, max_depth: int = 5,
             max_dirs: int = 20000) -> list[Path]:  # fmt: skip
    """The directories named ``job_<id>`` in the hierarchies Slurm tracks jobs by: the
    job's cgroups where proctrack/cgroup runs (none with proctrack/linuxproc, or without
    Slurm). A walk bounded in depth and size (Slurm puts them 2-4 levels down)."""
    name, out, seen = f"job_{job_id}", [], 0
    for mount in (m for m in found if m.controllers in TRACKING):
        level = [Path(mount.mountpoint)]
        for _ in range(max_depth):
            below = []
            for d in level:
                try:
                    subs = [e for e in os.scandir(d) if e.is_dir(follow_symlinks=False)]
                except OSError:
                    continue
                seen += len(subs)
                out += [Path(e.path) for e in subs if e.name == name]
                below += [Path(e.path) for e in subs if e.name != name]
            if out or seen > max_dirs:
                return out
            level = below
    return out
