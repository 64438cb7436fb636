"""A test's own cgroup-device program (what Slurm's ConstrainDevices attaches on cgroup v2):
it denies one character device and allows everything else. Loaded with ``bpf(2)`` by
hand, a test-only helper: spswap itself never loads a program, it carries Slurm's."""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path

from spswap.checkpoint import device_rules

BPF_PROG_LOAD = 5
BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_DEVCG_DEV_CHAR = 2


def _insn(op: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", op, (src << 4) | dst, off, imm)


def deny_char_program(major: int, minor: int) -> bytes:
    """Instructions: deny char device ``major:minor``, allow the rest."""
    return b"".join([
        _insn(0x61, 2, 1, 0),  # r2 = ctx->access_type
        _insn(0x57, 2, imm=0xFFFF),  # r2 &= 0xffff (the device type)
        _insn(0x55, 2, off=6, imm=BPF_DEVCG_DEV_CHAR),  # not a char device: allow
        _insn(0x61, 3, 1, 4),  # r3 = ctx->major
        _insn(0x55, 3, off=4, imm=major),
        _insn(0x61, 4, 1, 8),  # r4 = ctx->minor
        _insn(0x55, 4, off=2, imm=minor),
        _insn(0xB7, 0, imm=0),  # r0 = 0: deny
        _insn(0x95),
        _insn(0xB7, 0, imm=1),  # r0 = 1: allow
        _insn(0x95),
    ])  # fmt: skip


def load_deny_char(major: int, minor: int) -> int:
    """A loaded program's fd (raises OSError where BPF cannot load it)."""
    code = deny_char_program(major, minor)
    insns = ctypes.create_string_buffer(code, len(code))
    license_text = ctypes.create_string_buffer(b"GPL")
    attr = struct.pack("<IIQQ", BPF_PROG_TYPE_CGROUP_DEVICE, len(code) // 8,
                       ctypes.addressof(insns), ctypes.addressof(license_text))  # fmt: skip
    size = device_rules.ATTR_SIZE
    return device_rules.bpf_call(BPF_PROG_LOAD, ctypes.create_string_buffer(attr, size))


def attach_deny_char(cgroup_dir: Path, major: int, minor: int) -> None:
    """``cgroup_dir`` denies char device ``major:minor`` from now on."""
    prog_fd = load_deny_char(major, minor)
    try:
        fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            block = ctypes.create_string_buffer(device_rules.attach_attr(fd, prog_fd),
                                                device_rules.ATTR_SIZE)  # fmt: skip
            device_rules.bpf_call(device_rules.BPF_PROG_ATTACH, block)
        finally:
            os.close(fd)
    finally:
        os.close(prog_fd)
