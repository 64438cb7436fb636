"""Parking a process tree outside its Slurm job's cgroups while it is dumped.

Slurm's proctrack/cgroup ends a job by signalling every process in the job's cgroup:
a requeue (or preemption's kill after GraceTime) would cut a dump short. So right before
CRIU runs (the CUDA checkpoint has freed the tree's GPU memory by then) spswapd moves the
tree into a cgroup of its own (``spswap-parked-<root tag>-<job>-<pid>``, made beside
spswapd's own) in
the hierarchy Slurm tracks jobs by: cgroup v2, or v1's freezer (Slurm 22.05 on hybrid
hosts; the tree keeps its job's v1 memory, CPU and device cgroups). The job can then be
requeued at once and the next job start while the dump runs. Anything the tree forks
lands in the parked cgroup too, so nothing escapes: after the dump whatever is left
there is killed, or, when the dump failed and the job is still there, moved back home;
a tree the dump left running (a kept instance) waits there frozen until its job's next
run takes it.
A spswapd that starts ends what a dead one left parked (:func:`sweep`). The parsing
of /proc/<pid>/cgroup and /proc/self/mountinfo (:mod:`cgroup_paths`) is pure and tested
on exact text.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from spswap.checkpoint import device_rules
from spswap.checkpoint.cgroup_paths import (  # noqa: F401 - re-exported: callers use cgroups.X
    PROC,
    TRACKING,
    Membership,
    Mount,
    fs_path,
    memberships,
    mounts,
    own_dirs,
    parse_mountinfo,
    parse_proc_cgroup,
)
from spswap.checkpoint.device_rules import Carried
from spswap.errors import CheckpointFailed

PREFIX = "spswap-parked-"


@dataclass
class Parking:
    """A parked cgroup per hierarchy, and where each adopted pid came from."""

    name: str
    dirs: dict[str, Path] = field(default_factory=dict)  # controllers -> parked dir
    homes: dict[int, dict[str, Path]] = field(default_factory=dict)  # pid -> controllers -> dir
    # the job's device rules (cgroup v2's BPF programs) in the parked v2 cgroup: only
    # then may the tree run there with its GPUs open (see device_rules)
    devices: Carried = Carried.NOT_NEEDED
    devices_reason: str = ""

    @classmethod
    def create(cls, name: str, tree_pid: int, proc: Path = PROC) -> Parking | None:
        """Parked cgroups beside spswapd's own in each hierarchy where ``tree_pid`` is
        elsewhere; None when it is nowhere else (no job cgroups: nothing to leave).

        Raises CheckpointFailed when a cgroup cannot be made (read-only cgroupfs)."""
        found = mounts(proc)
        # only where Slurm tracks and kills (v2, v1 freezer): memory, CPU and device
        # limits of v1 hierarchies stay the job's
        mine = own_dirs(found, proc)
        parking = cls(name)
        for theirs in memberships(tree_pid, proc):
            base = mine.get(theirs.controllers)
            where = fs_path(theirs, found)
            if base is None or where is None or where == base:
                continue
            target = base / f"{PREFIX}{name}"
            try:
                target.mkdir(exist_ok=True)
            except OSError as e:
                parking.remove()
                raise CheckpointFailed(f"cannot make the parked cgroup {target}: {e}") from None
            parking.dirs[theirs.controllers] = target
            if theirs.controllers == "":
                parking.devices, parking.devices_reason = device_rules.carry(where, target)
        return parking if parking.dirs else None

    @property
    def holds_device_rules(self) -> bool:
        """Whether the parked tree meets the same device rules as in its job."""
        return self.devices is not Carried.FAILED

    def take_device_rules(self, like: Sequence[Membership], proc: Path = PROC) -> Carried:
        """Give the parked v2 cgroup the device rules in force for the cgroups ``like``
        (of the run that takes the tree back, read when it asked) instead of its old
        job's; the outcome (also in :attr:`devices`, the reason of a failure in
        :attr:`devices_reason`)."""
        target = self.dirs.get("")
        found = mounts(proc)  # once, not per membership (a restore's path)
        source = next((fs_path(m, found) for m in like if m.controllers == ""), None)
        if target is None or source is None:
            return self.devices
        self.devices, self.devices_reason = device_rules.replace(source, target)
        return self.devices

    def adopt(self, pids: list[int], proc: Path = PROC,
              members: Callable[[], set[int]] | None = None) -> None:  # fmt: skip
        """Move ``pids`` (whole processes) into the parked cgroups, remembering their
        homes. Raises CheckpointFailed after moving back what it moved. ``members``:
        read once after the moves; a moved process not in it (its pid taken by another
        process since the list was read) goes straight back home."""
        found = mounts(proc)
        moved = []
        for pid in pids:
            if pid in self.homes:
                continue
            home = {m.controllers: p for m in memberships(pid, proc)
                    if m.controllers in self.dirs and (p := fs_path(m, found))}  # fmt: skip
            self.homes[pid] = home
            for controllers in home:
                try:
                    (self.dirs[controllers] / "cgroup.procs").write_text(str(pid))
                except ProcessLookupError:
                    break
                except OSError as e:
                    self.return_home()
                    raise CheckpointFailed(f"cannot move pid {pid} out of its job's cgroup "
                                           f"({controllers or 'v2'}): {e}") from None  # fmt: skip
            moved.append(pid)
        if members is not None and moved:
            now = members()
            for pid in moved:
                if pid not in now:
                    self._send_home(pid)

    def pids(self) -> set[int]:
        """Every process in the parked cgroups (what the tree forked included)."""
        found: set[int] = set()
        for d in self.dirs.values():
            try:
                found.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except OSError:
                continue
        return found

    def return_home(self) -> list[int]:
        """Move every process still parked back where it came from (one forked since:
        where the first adopted one came from; an adopted pid that exited is not
        touched: its number may be another process's by now); returns the pids that could
        not go back (their job's cgroup is gone)."""
        stranded = []
        first = next(iter(self.homes.values()), {})
        for pid in sorted(self.pids()):
            for _controllers, d in self.homes.get(pid, first).items():
                try:
                    (d / "cgroup.procs").write_text(str(pid))
                except ProcessLookupError:
                    break
                except OSError:
                    stranded.append(pid)
                    break
        return stranded

    def _send_home(self, pid: int) -> None:
        """Move ``pid`` back to the cgroups it was taken from, and forget it."""
        for d in self.homes.pop(pid, {}).values():
            try:
                (d / "cgroup.procs").write_text(str(pid))
            except OSError:  # gone, or its home is: nothing more to do for it here
                break

    def kill_all(self, timeout_s: float = 30.0) -> list[int]:
        """End everything in the parked cgroups and wait until they are empty; returns
        the pids that were there."""
        return kill_cgroups(list(self.dirs.values()), timeout_s)

    def freeze_writes(self) -> list[tuple[Path, str]]:
        """The file writes that freeze the parked tree (v1's freezer, else v2's
        ``cgroup.freeze``); none without a freezer. For CRIU's post-dump step, which makes
        them before it lets a tree it leaves running go."""
        found = _freezer(self.dirs, True)
        return [(found[0], found[1])] if found else []

    def freeze(self, timeout_s: float = 10.0) -> bool:
        """Stop every parked process where it stands (v1's freezer, else v2's
        ``cgroup.freeze``) and wait until the kernel says frozen: a tree kept alive after
        its dump waits outside any job, and must not run there. False when no freezer is
        there or it did not settle in ``timeout_s`` (the caller ends the tree then)."""
        return _set_frozen(self.dirs, True, timeout_s)

    def thaw(self, timeout_s: float = 10.0) -> bool:
        """Undo :meth:`freeze`; True once the processes may run again."""
        return _set_frozen(self.dirs, False, timeout_s)

    def remove(self) -> None:
        """Remove the (empty) parked cgroups, with an empty freeze hold left in one."""
        for d in self.dirs.values():
            try:
                remove_bottom_up(d, kill=False)
            except OSError:
                continue


def _freezer(dirs: dict[str, Path], frozen: bool) -> tuple[Path, str, Path] | None:
    """(file to write, value, file that says when done): v1's freezer when parked
    there, else v2's cgroup.freeze; None without either."""
    if "freezer" in dirs:
        state = dirs["freezer"] / "freezer.state"
        return state, "FROZEN" if frozen else "THAWED", state
    if "" in dirs:
        return dirs[""] / "cgroup.freeze", "1" if frozen else "0", dirs[""] / "cgroup.events"
    return None


def _set_frozen(dirs: dict[str, Path], frozen: bool, timeout_s: float) -> bool:
    """Freeze or thaw (see :func:`_freezer`) and wait until the kernel says it is done."""
    found = _freezer(dirs, frozen)
    if found is None:
        return False
    path, want, status = found
    if path == status:  # v1: FREEZING until every task is frozen
        done = lambda: status.read_text().strip() == want  # noqa: E731
    else:  # v2: cgroup.events says "frozen 0|1"
        done = lambda: f"frozen {want}" in status.read_text().splitlines()  # noqa: E731
    deadline = time.monotonic() + timeout_s
    try:
        path.write_text(want)
        while not done():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
    except OSError:
        return False
    return True


def procs_of(d: Path) -> set[int]:
    """The pids in cgroup ``d`` (none when it cannot be read)."""
    try:
        return {int(x) for x in (d / "cgroup.procs").read_text().split()}
    except OSError:
        return set()


def kill_cgroups(dirs: list[Path], timeout_s: float = 30.0) -> list[int]:
    """SIGKILL every process in ``dirs`` without racing pid reuse: v2's ``cgroup.kill``,
    or v1's freezer frozen while its pids are read and signalled; waits (up to
    ``timeout_s``, a GPU process's teardown can be slow) until they are empty."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = set().union(*(procs_of(d) for d in dirs)) if dirs else set()
        if not left:
            break
        seen |= left
        for d in dirs:
            if (d / "cgroup.kill").exists():
                _write_quietly(d / "cgroup.kill", "1")
            elif (d / "freezer.state").exists():
                _write_quietly(d / "freezer.state", "FROZEN")
                for pid in procs_of(d):
                    _kill_quietly(pid)
                _write_quietly(d / "freezer.state", "THAWED")  # a frozen task cannot die
            else:
                for pid in procs_of(d):
                    _kill_quietly(pid)
        for pid in left:  # spswapd's own children (a restore's) need reaping
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        time.sleep(0.02)
    return sorted(seen)


def _write_quietly(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError:
        pass


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def root_tag(root: Path) -> str:
    """A short tag of a spswap root, in its parked cgroups' names: a daemon sweeps only
    its own (tests run several daemons on one host)."""
    import hashlib

    return hashlib.sha256(str(root).encode()).hexdigest()[:8]


def sweep(tag: str, proc: Path = PROC) -> list[str]:
    """At spswapd's start: parked cgroups a dead spswapd of the same root (``tag``) left
    beside its own. Their processes are ended (their jobs may have been requeued already,
    and where they came from is not known any more) and the cgroups removed; returns
    their paths."""
    try:
        bases = own_dirs(mounts(proc), proc).values()
    except OSError:
        return []
    found = []
    for base in bases:
        try:
            dirs = [d for d in base.iterdir()
                    if d.name.startswith(f"{PREFIX}{tag}-") and d.is_dir()]  # fmt: skip
        except OSError:
            continue
        kill_cgroups(dirs)  # v2's cgroup.kill takes a hold's tree/ (freeze_hold) too
        for d in dirs:
            try:
                remove_bottom_up(d)
                found.append(str(d))
            except OSError:
                continue
    return found


def remove_bottom_up(d: Path, kill: bool = True) -> None:
    """Remove the cgroup ``d`` and those below it, deepest first (a parked cgroup can hold
    a freeze hold, which holds ``tree/``: a child with a child of its own made the parked
    one's removal fail, and a restarted spswapd left it for good), their processes killed
    first where ``kill`` (else one with a process stays). OSError where one cannot go."""
    for child in [c for c in d.iterdir() if c.is_dir()]:
        remove_bottom_up(child, kill)
    if kill:
        kill_cgroups([d])
    d.rmdir()


def dirs_of(like: Sequence[Membership], proc: Path = PROC) -> list[Path]:
    """The directories of the cgroups ``like`` (a process's memberships), one per
    hierarchy mounted here: where a process started in them is what :func:`join` makes."""
    found = mounts(proc)
    return [d for m in like if (d := fs_path(m, found)) is not None]


def join(pids: list[int], like: Sequence[Membership], proc: Path = PROC) -> list[str]:
    """Move ``pids`` into the cgroups ``like`` (a process's memberships, read when it
    asked) wherever theirs differ (a restored tree into the cgroups of the job run it was
    restored for, so that Slurm's limits, device rules and end-of-job kill cover it);
    returns the hierarchies moved in."""
    found = mounts(proc)
    target = {m.controllers: m for m in like}
    moved: set[str] = set()
    for pid in pids:
        for m in memberships(pid, proc):
            want = target.get(m.controllers)
            if want is None or want.path == m.path or (d := fs_path(want, found)) is None:
                continue
            try:
                (d / "cgroup.procs").write_text(str(pid))
            except ProcessLookupError:
                break
            except OSError as e:
                raise CheckpointFailed(f"cannot move pid {pid} into {d}: {e}") from None
            moved.add(m.controllers or "v2")
    return sorted(moved)


def park_probe(proc: Path = PROC) -> tuple[bool, str]:
    """Can this process make a cgroup beside its own (what parking needs), in the
    hierarchies Slurm's proctrack/cgroup uses (v2, or v1's freezer)? (ok, what was found)"""
    try:
        bases = own_dirs(mounts(proc), proc)
    except OSError as e:
        return False, f"cannot read mountinfo: {e}"
    tried = []
    for controllers, base in bases.items():
        name = controllers or "v2"
        probe = base / f"{PREFIX}probe-{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
            return True, f"{name}: {base}"
        except OSError as e:
            tried.append(f"{name}: {e.strerror or e}")
    return False, "; ".join(tried) or "no cgroup v2 or v1 freezer mounted"
