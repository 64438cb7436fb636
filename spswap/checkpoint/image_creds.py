"""The credentials a CRIU image would give back its processes, read from the image itself.

CRIU restores every task with the credentials it recorded at the dump (uids, gids,
groups, capability sets: ``creds_entry`` inside each thread's ``core-<tid>.img``). The
daemon checks the live tree before the dump, but what counts is what the image holds: a
tree that exec'd a setuid program just before CRIU seized it is recorded with that
program's rights. So every image is read back here after the dump (before it gets its
name) and again before a restore, and one that holds a task of another uid, gid, group or
with a capability is refused.

Read with :mod:`criu_image` (no ``crit``/pycriu: CRIU's bundle ships neither); only the
fields needed are decoded (images/core.proto, creds.proto and pstree.proto of CRIU 4.1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from spswap.checkpoint.criu_image import entries, fields, read_image_file, varint
from spswap.errors import ImageUnreadable

CORE_MAGIC = 0x55053847
PSTREE_MAGIC = 0x50273030
TASK_DEAD = 2  # a zombie: CRIU records no credentials, and restores it only to exit


@dataclass(frozen=True)
class Creds:
    """One task's ``creds_entry``: its uids (real, effective, saved, fs), gids likewise,
    supplementary groups and capability sets (32-bit words, low word first)."""

    uids: tuple[int, int, int, int]
    gids: tuple[int, int, int, int]
    groups: tuple[int, ...] = ()
    cap_inh: tuple[int, ...] = ()
    cap_prm: tuple[int, ...] = ()
    cap_eff: tuple[int, ...] = ()
    cap_amb: tuple[int, ...] = ()


@dataclass(frozen=True)
class TaskCore:
    """What a ``core-<tid>.img`` says about credentials: the task state and its creds
    (None where the image has none: a zombie, or a format too old to say)."""

    tid: int
    task_state: int | None
    creds: Creds | None


@dataclass
class PstreeEntry:
    pid: int
    threads: list[int] = field(default_factory=list)


def _repeated_u32(entries: list[tuple[int, int, int | bytes]], number: int) -> tuple[int, ...]:
    """A repeated uint32 field, packed or not."""
    values: list[int] = []
    for n, wire, v in entries:
        if n != number:
            continue
        if wire == 0:
            values.append(int(v))  # type: ignore[arg-type]
        elif wire == 2:
            pos, raw = 0, bytes(v)  # type: ignore[arg-type]
            while pos < len(raw):
                x, pos = varint(raw, pos)
                values.append(x)
    return tuple(values)


def _one(entries: list[tuple[int, int, int | bytes]], number: int) -> int | bytes | None:
    found = [v for n, _, v in entries if n == number]
    return found[-1] if found else None  # protobuf: the last one wins


def parse_creds(msg: bytes) -> Creds:
    """A ``creds_entry`` (creds.proto: uid 1, gid 2, euid 3, egid 4, suid 5, sgid 6,
    fsuid 7, fsgid 8, cap_inh 9, cap_prm 10, cap_eff 11, groups 14, cap_amb 19)."""
    f = fields(msg)
    ids = {}
    for n in range(1, 9):
        v = _one(f, n)
        if not isinstance(v, int):
            raise ImageUnreadable(f"creds_entry lacks field {n}")
        ids[n] = v
    return Creds(
        uids=(ids[1], ids[3], ids[5], ids[7]), gids=(ids[2], ids[4], ids[6], ids[8]),
        groups=_repeated_u32(f, 14), cap_inh=_repeated_u32(f, 9),
        cap_prm=_repeated_u32(f, 10), cap_eff=_repeated_u32(f, 11),
        cap_amb=_repeated_u32(f, 19),
    )  # fmt: skip


def parse_core(data: bytes, tid: int) -> TaskCore:
    """A ``core-<tid>.img``: core_entry's tc (3, task_state 1) and thread_core (5,
    creds 10)."""
    msgs = entries(data, CORE_MAGIC)
    if len(msgs) != 1:
        raise ImageUnreadable(f"core image of {tid} holds {len(msgs)} entries, not 1")
    core = fields(msgs[0])
    tc, thread_core = _one(core, 3), _one(core, 5)
    state = _one(fields(tc), 1) if isinstance(tc, bytes) else None
    creds = None
    if isinstance(thread_core, bytes):
        raw = _one(fields(thread_core), 10)
        creds = parse_creds(raw) if isinstance(raw, bytes) else None
    return TaskCore(tid, int(state) if isinstance(state, int) else None, creds)


def parse_pstree(data: bytes) -> list[PstreeEntry]:
    """``pstree.img``: pstree_entry's pid (1) and threads (5)."""
    out = []
    for msg in entries(data, PSTREE_MAGIC):
        f = fields(msg)
        pid = _one(f, 1)
        if not isinstance(pid, int):
            raise ImageUnreadable("pstree entry without a pid")
        out.append(PstreeEntry(pid, list(_repeated_u32(f, 5))))
    return out


def read_cores(image_dir: Path) -> list[TaskCore]:
    """Every task the image would restore (by its pstree), with its recorded creds.
    ImageUnreadable when a file is missing or not what it should be."""
    tree = parse_pstree(read_image_file(image_dir / "pstree.img"))
    cores = []
    for entry in tree:
        main = _read_core(image_dir, entry.pid)
        cores.append(main)
        if main.task_state == TASK_DEAD:
            continue  # a zombie has one core and no threads to restore
        cores += [_read_core(image_dir, tid) for tid in entry.threads if tid != entry.pid]
    return cores


def _read_core(image_dir: Path, tid: int) -> TaskCore:
    return parse_core(read_image_file(image_dir / f"core-{tid}.img"), tid)


def creds_problem(cores: list[TaskCore], uid: int, allowed_groups: set[int] | None) -> str | None:
    """Why an image with these tasks may not be kept nor restored for ``uid``; None when
    every task is that user's: all four uids ``uid``, one gid (a group of the user when
    the user database knows the user), supplementary groups the user's, and no
    capability in the inheritable, permitted, effective or ambient set. Root's own jobs
    (``uid`` 0) are only held to uid 0. A zombie (no creds: it is restored only to exit)
    passes; any other task without creds fails (CRIU would read them from elsewhere)."""
    if not cores:
        return "the image holds no task"
    for core in cores:
        c = core.creds
        if c is None:
            if core.task_state == TASK_DEAD:
                continue
            return f"task {core.tid} has no credentials recorded in the image"
        if set(c.uids) != {uid}:
            return f"task {core.tid} was dumped with uids {list(c.uids)}, not only {uid}"
        if uid == 0:
            continue
        if len(set(c.gids)) > 1:
            return f"task {core.tid} was dumped with several gids {list(c.gids)} (a setgid program)"
        if allowed_groups is not None and not set(c.gids) | set(c.groups) <= allowed_groups:
            foreign = sorted((set(c.gids) | set(c.groups)) - allowed_groups)
            return f"task {core.tid} was dumped with group(s) {foreign}, not groups of uid {uid}"
        for name, caps in (("inheritable", c.cap_inh), ("permitted", c.cap_prm),
                           ("effective", c.cap_eff), ("ambient", c.cap_amb)):  # fmt: skip
            if any(caps):
                words = "".join(f"{w:08x}" for w in reversed(caps))
                return f"task {core.tid} was dumped with {name} capabilities {words}"
    return None


def image_problem(image_dir: Path, uid: int, allowed_groups: set[int] | None) -> str | None:
    """:func:`creds_problem` of the image in ``image_dir``; an image that cannot be read
    is a problem too (it cannot be shown to be harmless)."""
    try:
        cores = read_cores(image_dir)
    except ImageUnreadable as e:
        return f"its credentials cannot be read ({e})"
    return creds_problem(cores, uid, allowed_groups)
