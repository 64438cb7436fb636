"""A job's device rules carried to the cgroup v2 its tree is parked in.

On cgroup v2 Slurm's ``ConstrainDevices`` is a BPF program (type cgroup-device) attached
to the job's and the step's cgroups: a process there may open only its job's GPUs. A tree
that spswapd parks outside its job (:class:`spswap.checkpoint.cgroups.Parking`) would leave
those rules behind, and it runs there for a while: a kept instance is thawed and given its
GPU state back before it joins its next run, and a dump's CUDA checkpoint runs after the
park when the rules came along. So the parked cgroup gets the very programs that are in
force where the tree was (the kernel's effective list, queried by ``BPF_PROG_QUERY``),
attached again by id (``BPF_PROG_GET_FD_BY_ID`` + ``BPF_PROG_ATTACH``, multi mode: every
program must allow an access, as in the job). Nothing is written or compiled here: the
programs are Slurm's own.

The ``bpf(2)`` argument blocks are built by pure functions (tested on their exact bytes);
the calls need root (CAP_SYS_ADMIN or CAP_BPF).
"""

from __future__ import annotations

import ctypes
import enum
import os
import platform
import struct
from pathlib import Path

# bpf(2) commands, attach type and flags (linux/bpf.h)
BPF_PROG_ATTACH = 8
BPF_PROG_DETACH = 9
BPF_PROG_GET_FD_BY_ID = 13
BPF_PROG_QUERY = 16
BPF_CGROUP_DEVICE = 6
BPF_F_ALLOW_MULTI = 1 << 1
BPF_F_QUERY_EFFECTIVE = 1 << 0
ATTR_SIZE = 128  # larger than every union member used here; the kernel wants the rest zero
MAX_PROGRAMS = 64
_SYSCALL = {"x86_64": 321, "amd64": 321, "aarch64": 280, "arm64": 280, "ppc64le": 361}


class Carried(enum.Enum):
    """What became of the device rules when a tree was parked."""

    NOT_NEEDED = "not needed"  # no device programs where the tree was (or not cgroup v2)
    COPIED = "copied"  # the parked cgroup enforces the same programs
    FAILED = "failed"  # the tree had rules the parked cgroup does not enforce


# ---- pure: the argument blocks ---------------------------------------------------------------


def query_attr(cgroup_fd: int, ids_address: int, capacity: int, effective: bool = True) -> bytes:
    """``BPF_PROG_QUERY`` of the cgroup-device programs of ``cgroup_fd`` (those in force
    there, or only those attached to it), their ids written to ``capacity`` u32s at
    ``ids_address``."""
    flags = BPF_F_QUERY_EFFECTIVE if effective else 0
    head = struct.pack("<IIIIQI", cgroup_fd, BPF_CGROUP_DEVICE, flags, 0, ids_address, capacity)
    return head.ljust(ATTR_SIZE, b"\0")


def query_count(attr: bytes) -> int:
    """How many program ids the kernel wrote back into a :func:`query_attr` block."""
    return int(struct.unpack_from("<I", attr, 24)[0])


def fd_by_id_attr(prog_id: int) -> bytes:
    """``BPF_PROG_GET_FD_BY_ID`` of program ``prog_id``."""
    return struct.pack("<III", prog_id, 0, 0).ljust(ATTR_SIZE, b"\0")


def attach_attr(cgroup_fd: int, prog_fd: int, detach: bool = False) -> bytes:
    """``BPF_PROG_ATTACH`` of a cgroup-device program to ``cgroup_fd``, multi mode (or
    the ``BPF_PROG_DETACH`` of it)."""
    flags = 0 if detach else BPF_F_ALLOW_MULTI
    head = struct.pack("<IIIII", cgroup_fd, prog_fd, BPF_CGROUP_DEVICE, flags, 0)
    return head.ljust(ATTR_SIZE, b"\0")


# ---- the calls -----------------------------------------------------------------------------


def bpf_call(cmd: int, attr: ctypes.Array[ctypes.c_char]) -> int:
    """``bpf(cmd, attr, ATTR_SIZE)``: its result, or OSError with the kernel's errno."""
    number = _SYSCALL.get(platform.machine().lower())
    if number is None:
        raise OSError(f"bpf(2) is not known on {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    result = int(libc.syscall(number, cmd, attr, ATTR_SIZE))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def _open_dir(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


def effective_programs(cgroup_dir: Path, effective: bool = True) -> list[int]:
    """Ids of the cgroup-device programs in force for processes in ``cgroup_dir`` (a
    cgroup v2 directory; not ``effective``: only those attached to it). Raises OSError
    when the kernel cannot say."""
    fd = _open_dir(cgroup_dir)
    try:
        ids = (ctypes.c_uint32 * MAX_PROGRAMS)()
        block = query_attr(fd, ctypes.addressof(ids), MAX_PROGRAMS, effective)
        attr = ctypes.create_string_buffer(block, ATTR_SIZE)
        bpf_call(BPF_PROG_QUERY, attr)
        return [int(ids[i]) for i in range(min(query_count(attr.raw), MAX_PROGRAMS))]
    finally:
        os.close(fd)


def attach(cgroup_dir: Path, prog_ids: list[int], detach: bool = False) -> None:
    """Attach the programs ``prog_ids`` to ``cgroup_dir`` (or detach them). Raises OSError."""
    fd = _open_dir(cgroup_dir)
    try:
        for prog_id in prog_ids:
            by_id = ctypes.create_string_buffer(fd_by_id_attr(prog_id), ATTR_SIZE)
            prog_fd = bpf_call(BPF_PROG_GET_FD_BY_ID, by_id)
            try:
                block = attach_attr(fd, prog_fd, detach)
                bpf_call(BPF_PROG_DETACH if detach else BPF_PROG_ATTACH,
                     ctypes.create_string_buffer(block, ATTR_SIZE))  # fmt: skip
            finally:
                os.close(prog_fd)
    finally:
        os.close(fd)


def carry(source: Path, target: Path) -> tuple[Carried, str]:
    """Give ``target`` (a new, empty cgroup v2) the device rules in force at ``source``;
    the outcome and, when it failed, why (never raises)."""
    try:
        ids = effective_programs(source)
    except OSError as e:
        return Carried.FAILED, f"cannot read the device rules of {source}: {e}"
    if not ids:
        return Carried.NOT_NEEDED, ""
    try:
        attach(target, ids)
    except OSError as e:
        return Carried.FAILED, f"cannot give {target} the device rules of {source}: {e}"
    return Carried.COPIED, ""


def replace(source: Path, target: Path) -> tuple[Carried, str]:
    """Swap the device rules attached to ``target`` (a parked cgroup) for those in force
    at ``source`` (the cgroup of the run that takes the tree back): a kept tree is
    thawed and given its GPUs under its new run's rules, which may name other GPUs."""
    try:
        old = effective_programs(target, effective=False)
        new = effective_programs(source)
    except OSError as e:
        return Carried.FAILED, f"cannot read the device rules of {source} or {target}: {e}"
    if old == new:
        return (Carried.COPIED if new else Carried.NOT_NEEDED), ""
    try:
        attach(target, [p for p in new if p not in old])
        attach(target, [p for p in old if p not in new], detach=True)
    except OSError as e:
        return Carried.FAILED, f"cannot give {target} the device rules of {source}: {e}"
    return (Carried.COPIED if new else Carried.NOT_NEEDED), ""
