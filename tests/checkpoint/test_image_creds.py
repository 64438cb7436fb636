"""The reader of the credentials a CRIU image holds, on exact bytes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spswap.checkpoint import image_creds as ic
from spswap.checkpoint.criu_image import MAX_IMAGE_FILE_BYTES
from spswap.errors import ImageUnreadable

from . import criu_images as ci

# A core image as CRIU 4.1 lays it out, written out byte by byte: common magic, core
# magic, one entry of 0x37 bytes: mtype 1 (x86_64), tc {task_state 1, exit_code 0,
# personality 0, flags 0, blk_sigset 0, comm "py"}, thread_core {futex_rla 0,
# futex_rla_len 0, creds {gid 995 x4, uid 999 x4 (field order as CRIU packs them: by
# number), cap_eff 0x2000 (cap_net_raw), secbits 0}}.
CORE_WITH_CAP = bytes.fromhex(
    "19435654"
    "47380555"  # IMG_COMMON_MAGIC, CORE_MAGIC (little endian)
    "37000000"  # entry size 0x37
    "0801"  # mtype = 1
    "1a0e"
    "0801"
    "1000"
    "1800"
    "2000"
    "2800"
    "32027079"  # tc (14 bytes)
    "2a23"
    "0800"
    "1000"  # thread_core (35 bytes): futex_rla, futex_rla_len
    "521d"  # creds (29 bytes)
    "08e707"
    "10e307"
    "18e707"
    "20e307"
    "28e707"
    "30e307"
    "38e707"
    "40e307"
    "588040"  # cap_eff = 0x2000
    "6800"  # secbits
)


def test_a_core_image_read_from_exact_bytes() -> None:
    core = ic.parse_core(CORE_WITH_CAP, 42)
    assert core == ic.TaskCore(42, 1, ic.Creds(
        uids=(999, 999, 999, 999), gids=(995, 995, 995, 995), cap_eff=(0x2000,)))  # fmt: skip
    assert ic.creds_problem([core], 999, {995}) == (
        "task 42 was dumped with effective capabilities 00002000"
    )


def test_the_test_writer_agrees_with_the_hand_written_bytes() -> None:
    """criu_images (used by the stand-in CRIU) makes what the reader reads."""
    entry = ci.creds((999, 0, 0, 0), (995,) * 4, groups=(995, 27))
    core = ic.parse_core(ci.core_img(1, entry), 7)
    assert core.creds is not None
    assert core.creds.uids == (999, 0, 0, 0) and core.creds.groups == (995, 27)
    assert core.creds.cap_prm == (0, 0)


def test_packed_repeated_fields_are_read_too() -> None:
    msg = b"".join(ci.field_varint(n, v) for n, v in zip(range(1, 9), [5] * 8, strict=True))
    msg += ci.field_bytes(10, ci.varint(0) + ci.varint(0x40))  # cap_prm packed: 0, 0x40
    assert ic.parse_creds(msg).cap_prm == (0, 0x40)


@pytest.mark.parametrize(("uids", "gids", "groups", "caps", "problem"), [
    ((999,) * 4, (995,) * 4, (995,), {}, None),
    ((999, 0, 0, 0), (995,) * 4, (), {},
     "task 1 was dumped with uids [999, 0, 0, 0], not only 999"),
    ((999,) * 4, (995, 0, 0, 0), (), {},
     "task 1 was dumped with several gids [995, 0, 0, 0] (a setgid program)"),
    ((999,) * 4, (0,) * 4, (), {}, "task 1 was dumped with group(s) [0], not groups of uid 999"),
    ((999,) * 4, (995,) * 4, (995, 4), {},
     "task 1 was dumped with group(s) [4], not groups of uid 999"),
    ((999,) * 4, (995,) * 4, (), {10: (0, 1)},
     "task 1 was dumped with permitted capabilities 0000000100000000"),
    ((999,) * 4, (995,) * 4, (), {19: (1, 0)},
     "task 1 was dumped with ambient capabilities 0000000000000001"),
    ((999,) * 4, (995,) * 4, (), {9: (4, 0)},
     "task 1 was dumped with inheritable capabilities 0000000000000004"),
])  # fmt: skip
def test_what_an_image_may_hold(uids: tuple[int, int, int, int], gids: tuple[int, int, int, int],
                                groups: tuple[int, ...], caps: dict[int, tuple[int, int]],
                                problem: str | None) -> None:  # fmt: skip
    core = ic.parse_core(ci.core_img(1, ci.creds(uids, gids, groups, caps)), 1)
    assert ic.creds_problem([core], 999, {995}) == problem


def test_root_jobs_and_zombies() -> None:
    all_caps = {10: (0xFFFFFFFF, 0x1FF), 11: (0xFFFFFFFF, 0x1FF)}
    root = ic.parse_core(ci.core_img(1, ci.creds((0,) * 4, (0, 5, 0, 0), caps=all_caps)), 1)
    assert ic.creds_problem([root], 0, None) is None
    zombie = ic.parse_core(ci.core_img(ic.TASK_DEAD, None), 2)
    assert ic.creds_problem([zombie], 999, {995}) is None
    alive_without = ic.parse_core(ci.core_img(1, None), 3)
    assert ic.creds_problem([alive_without], 999, {995}) == (
        "task 3 has no credentials recorded in the image"
    )
    assert ic.creds_problem([], 999, None) == "the image holds no task"


def test_an_image_directory(tmp_path: Path) -> None:
    good = ci.creds((999,) * 4, (995,) * 4)
    (tmp_path / "pstree.img").write_bytes(ci.pstree_img([(10, 0, [10, 11]), (12, 10, [12])]))
    (tmp_path / "core-10.img").write_bytes(ci.core_img(1, good))
    (tmp_path / "core-11.img").write_bytes(ci.core_img(1, good))
    (tmp_path / "core-12.img").write_bytes(ci.core_img(1, ci.creds((999, 0, 0, 0), (995,) * 4)))
    assert [c.tid for c in ic.read_cores(tmp_path)] == [10, 11, 12]
    assert ic.image_problem(tmp_path, 999, {995}) == (
        "task 12 was dumped with uids [999, 0, 0, 0], not only 999"
    )
    (tmp_path / "core-11.img").unlink()
    assert ic.image_problem(tmp_path, 999, {995}) == (
        "its credentials cannot be read (cannot read core-11.img: No such file or directory)"
    )
    # a user's CRIU writes the directory: a link (to a file root could read), a FIFO (that
    # would hang root's read) or an outsized file is refused, never followed nor read
    (tmp_path / "core-11.img").symlink_to(tmp_path / "core-10.img")
    assert "cannot read core-11.img: Too many levels of symbolic links" in str(
        ic.image_problem(tmp_path, 999, {995}))  # fmt: skip
    (tmp_path / "core-11.img").unlink()
    os.mkfifo(tmp_path / "core-11.img")
    assert ic.image_problem(tmp_path, 999, {995}) == (
        "its credentials cannot be read (core-11.img is not a regular file)")  # fmt: skip
    (tmp_path / "core-11.img").unlink()
    with open(tmp_path / "core-11.img", "wb") as f:
        f.truncate(MAX_IMAGE_FILE_BYTES + 1)
    assert "holds 67108865 bytes, more than an image file" in str(
        ic.image_problem(tmp_path, 999, {995}))  # fmt: skip


@pytest.mark.parametrize(("data", "error"), [
    (b"\x19\x43", "shorter than a magic"),
    (bytes.fromhex("19435654" "30302750"), "magic 0x50273030, expected 0x55053847"),
    (bytes.fromhex("19435654" "47380555" "10000000" "0801"), "truncated entry"),
    (bytes.fromhex("19435654" "47380555" "02000000" "08ff"), "truncated varint"),
    (bytes.fromhex("19435654" "47380555" "01000000" "0b"),
     "wire type 3 (field 1) is not supported"),
])  # fmt: skip
def test_bad_bytes_are_refused(data: bytes, error: str) -> None:
    with pytest.raises(ImageUnreadable, match=error.replace("(", r"\(").replace(")", r"\)")):
        ic.parse_core(data, 1)
