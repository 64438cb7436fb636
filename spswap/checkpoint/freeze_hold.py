"""The tree frozen from its last credential check until CRIU holds it.

CRIU restores the credentials a task had when CRIU seized it. Checked on a running tree,
a child could exec a setuid program between the check and the seize and be dumped with
root's rights. So right before CRIU runs (after the CUDA checkpoint, which needs the tree
running) the tree is moved into a cgroup v2 of root's and frozen there; the daemon checks
every process in it, frozen, and CRIU gets the cgroup as ``--freeze-cgroup``: it seizes
the frozen tasks and only then thaws them (they stop for CRIU before they run an
instruction), and freezes them again when it lets a tree it leaves running go.

The hold is two cgroups: ``<base>/spswap-parked-<tag>-hold-<random>/`` (root's, 0700) and
in it ``tree/``, where the processes are. ``base`` is the tree's parked cgroup when the
daemon parked it outside its job in cgroup v2, else spswapd's own v2 cgroup. CRIU as the
job's user must write ``tree/cgroup.freeze`` (to thaw after its seize): the file is
given to the user for the run, and CRIU reaches it through a descriptor root opened
(``/proc/self/fd/N``); the user's other processes cannot, the 0700 parent bars the path,
so no one but CRIU can thaw the tree between the check and the seize.

Without a cgroup v2 hierarchy (a v1-only host) there is no hold: the image's credentials,
checked after the dump (:mod:`image_creds`), are then the only guard.

spswapd's start-up sweep (:func:`cgroups.sweep`) ends what a dead spswapd left in the
holds of its root's tag. A hold made without a tag (``spswap-parked-hold-<random>``: a
dump outside spswapd, a test's or a script's, whose process died before its release)
is nobody's: the sweep removes those too, only when empty and made a while ago
(:func:`sweep_empty_holds`), never a process in them. A running spswapd's periodic sweep
removes its own tag's holds that are empty and made a while ago: a release whose tree
was still leaving after its wait left its hold behind (CI, 2026-12-07).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from spswap.checkpoint import cgroups, proctree
from spswap.errors import CheckpointFailed

FREEZE_WAIT_S = 10.0


@dataclass
class FreezeHold:
    """A frozen tree in root's hold cgroup; :meth:`release` puts it back."""

    top: Path  # root's 0700 parent
    tree: Path  # the cgroup the processes are in
    homes: dict[int, Path] = field(default_factory=dict)  # pid -> its v2 cgroup before
    fd: int | None = None  # root's descriptor of ``tree`` for a user's CRIU

    @classmethod
    def create(cls, root_pid: int, tag: str = "", proc: Path = cgroups.PROC) -> FreezeHold | None:
        """Move the tree of ``root_pid`` into a new hold and freeze it; None when this
        host has no cgroup v2 or its cgroups cannot be made there (a read-only cgroupfs:
        the image's credentials are then the only guard). CheckpointFailed when the tree
        cannot be moved or frozen (it is back where it was then)."""
        try:
            found = cgroups.mounts(proc)
        except OSError:
            return None
        own = cgroups.own_dirs(found, proc).get("")
        theirs = next((m for m in cgroups.memberships(root_pid, proc) if m.controllers == ""),
                      None)  # fmt: skip
        where = cgroups.fs_path(theirs, found) if theirs is not None else None
        if own is None or where is None:
            return None
        base = where if where.name.startswith(cgroups.PREFIX) else own
        top = base / hold_name(tag, secrets.token_hex(4))
        try:
            top.mkdir(mode=0o700)
            os.chmod(top, 0o700)  # cgroupfs ignores mkdir's mode
            (top / "tree").mkdir()
        except OSError:
            _rmdir(top / "tree")
            _rmdir(top)
            return None  # as without cgroup v2 (doctor's "freeze for the check" says so)
        hold = cls(top, top / "tree")
        try:
            hold._adopt(root_pid, found, proc)
            if not hold._freeze():
                raise CheckpointFailed(f"the tree did not freeze in {hold.tree}")
            missing = set(proctree.process_tree_pids(root_pid)) - hold.pids()
            if missing:
                raise CheckpointFailed(f"processes {sorted(missing)} of the tree are outside "
                                       "its freeze")  # fmt: skip
        except BaseException:
            hold.release()
            raise
        return hold

    def _adopt(self, root_pid: int, found: list[cgroups.Mount], proc: Path) -> None:
        new = proctree.process_tree_pids(root_pid)
        for _ in range(3):  # again for anything forked meanwhile
            for pid in new:
                m = next((m for m in cgroups.memberships(pid, proc) if m.controllers == ""),
                         None)  # fmt: skip
                home = cgroups.fs_path(m, found) if m is not None else None
                if home is None:
                    continue  # gone
                self.homes[pid] = home
                try:
                    (self.tree / "cgroup.procs").write_text(str(pid))
                except ProcessLookupError:
                    continue
                except OSError as e:
                    raise CheckpointFailed(f"cannot move pid {pid} into {self.tree} to freeze "
                                           f"it: {e}") from None  # fmt: skip
            new = [p for p in proctree.process_tree_pids(root_pid) if p not in self.homes]
            if not new:
                return
        raise CheckpointFailed(f"the tree keeps forking ({len(new)} new processes)")

    def _freeze(self) -> bool:
        deadline = time.monotonic() + FREEZE_WAIT_S
        try:
            (self.tree / "cgroup.freeze").write_text("1")
            while "frozen 1" not in (self.tree / "cgroup.events").read_text().split("\n"):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.002)
        except OSError:
            return False
        return True

    def _clear_freeze(self) -> None:
        try:
            (self.tree / "cgroup.freeze").write_text("0")
        except OSError:
            pass

    def pids(self) -> set[int]:
        """Every process in the hold."""
        try:
            return {int(x) for x in (self.tree / "cgroup.procs").read_text().split()}
        except OSError:
            return set()

    def for_criu(self, user: tuple[int, int] | None) -> tuple[str, list[int]]:
        """CRIU's ``--freeze-cgroup`` argument and the descriptors it must inherit: the
        path for root's CRIU; for a user's (``user``: uid, gid), ``tree/cgroup.freeze``
        given to that user and the cgroup reached through root's descriptor."""
        if user is None:
            return str(self.tree), []
        os.chown(self.tree / "cgroup.freeze", user[0], user[1])
        if self.fd is None:
            self.fd = os.open(self.tree, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return f"/proc/self/fd/{self.fd}", [self.fd]

    def release(self) -> list[int]:
        """Put every process still in the hold back where it came from (a tree CRIU left
        running goes back frozen or not as its home is: a parked tree that CRIU's
        post-dump step froze stays frozen), then remove the hold. What cannot go home
        (its cgroup is gone) is killed; returns those pids. Never raises."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            os.chown(self.tree / "cgroup.freeze", 0, 0)
        except OSError:
            pass
        stranded = []
        first = next(iter(self.homes.values()), None)
        for pid in sorted(self.pids()):
            home = self.homes.get(pid, first)
            try:
                if home is None:
                    raise OSError("no home")
                (home / "cgroup.procs").write_text(str(pid))
            except ProcessLookupError:
                continue
            except OSError:
                stranded.append(pid)
        if stranded:
            cgroups.kill_cgroups([self.tree])
        # Cleared, not waited for: the hold is empty by now, and one inside a parked
        # cgroup that is frozen (a kept tree, frozen by CRIU's post-dump step) stays
        # "frozen 1" whatever it is told, so a wait would run to its end (it cost every
        # kept dump 10 s).
        self._clear_freeze()
        _rmdir(self.tree, wait_s=RMDIR_WAIT_S)  # a task CRIU just killed is still leaving
        _rmdir(self.top)
        return stranded


RMDIR_WAIT_S = 5.0
# a hold in use is empty only for the moments of its making, and from CRIU's end of a
# tree it does not keep to the hold's release (a sweep's rmdir then races the release's,
# harmlessly: a cgroup with a process in it is never removed, and the release takes a
# hold already gone as removed). Its age is its top's mtime: set when tree/ is made.
EMPTY_STALE_S = 60.0


def hold_name(tag: str, token: str) -> str:
    """A hold's cgroup name: ``spswap-parked-<tag>-hold-<token>``, and without a tag
    ``spswap-parked-hold-<token>``. Pure."""
    return f"{cgroups.PREFIX}{tag + '-' if tag else ''}hold-{token}"


def hold_of(name: str, tag: str) -> bool:
    """Whether ``name`` is a hold made with ``tag`` ("": without a tag, of no spswapd's
    root). Pure: a daemon's tag is hex (:func:`cgroups.root_tag`), never "hold"."""
    return re.fullmatch(re.escape(hold_name(tag, "")) + r"[0-9a-f]{8}", name) is not None


def sweepable(name: str, age_s: float, pids: int, tag: str = "") -> bool:
    """Whether a sweep for ``tag`` removes the cgroup ``name``, made ``age_s`` ago and
    holding ``pids`` processes: a hold of ``tag``, empty, older than
    :data:`EMPTY_STALE_S` (one being made right now is empty for a moment). Pure."""
    return hold_of(name, tag) and pids == 0 and age_s > EMPTY_STALE_S


def sweep_empty_holds(tag: str = "", proc: Path = cgroups.PROC,
                      now_s: float | None = None) -> list[str]:  # fmt: skip
    """Remove the empty holds of ``tag`` (:func:`sweepable`) where a process makes them:
    in its own v2 cgroup (where :func:`cgroups.sweep` looks) and, for a daemon's tag,
    inside its parked cgroups (a parked tree's hold is made there). The untagged ones at
    spswapd's start, its own tag's in its periodic sweep; returns their paths. Never
    raises."""
    try:
        own = cgroups.own_dirs(cgroups.mounts(proc), proc).get("")
        found = []
        for d in own.iterdir() if own else []:
            if hold_of(d.name, tag):
                found.append(d)
            elif tag and d.name.startswith(f"{cgroups.PREFIX}{tag}-") and d.is_dir():
                found += [h for h in d.iterdir() if hold_of(h.name, tag)]
    except OSError:
        return []
    now_s = time.time() if now_s is None else now_s
    swept = []
    for top in found:
        try:
            age_s = now_s - top.stat().st_mtime
        except OSError:
            continue
        parts = [top / "tree", top]
        pids = sum(len(cgroups.procs_of(d)) for d in parts)
        if sweepable(top.name, age_s, pids, tag):
            for d in parts:
                _rmdir(d)
            if not top.exists():
                swept.append(str(top))
    return swept


def _rmdir(d: Path, wait_s: float = 0.0) -> None:
    """Remove a cgroup; a busy one (tasks not yet reaped) again until ``wait_s`` passed."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            d.rmdir()
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                return
            time.sleep(0.01)


def probe(proc: Path = cgroups.PROC) -> tuple[bool, str]:
    """Can this process make a hold (a cgroup v2 beside its own, with a freezer)? For
    ``spswap doctor``: (ok, what was found)."""
    try:
        own = cgroups.own_dirs(cgroups.mounts(proc), proc).get("")
    except OSError as e:
        return False, f"cannot read mountinfo: {e}"
    if own is None:
        return False, "no cgroup v2 hierarchy mounted"
    d = own / f"{cgroups.PREFIX}probe-hold-{os.getpid()}"
    try:
        d.mkdir()
        try:
            ok = (d / "cgroup.freeze").exists()
        finally:
            d.rmdir()
    except OSError as e:
        return False, f"cannot make a cgroup in {own}: {e.strerror or e}"
    return (True, f"cgroup v2: {own}") if ok else (False, f"{own} has no cgroup.freeze")
