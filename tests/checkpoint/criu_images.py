"""Writing CRIU's image format for the tests (the reverse of spswap.checkpoint.image_creds):
protobuf fields by hand, so the reader is tested on bytes it did not make itself, and a
stand-in CRIU can record what it was handed."""

from __future__ import annotations

import struct

from spswap.checkpoint.criu_image import IMG_COMMON_MAGIC
from spswap.checkpoint.image_creds import CORE_MAGIC, PSTREE_MAGIC


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field_varint(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value)


def field_bytes(number: int, value: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(value)) + value


def creds(
    uids: tuple[int, int, int, int],
    gids: tuple[int, int, int, int],
    groups: tuple[int, ...] = (),
    caps: dict[int, tuple[int, int]] | None = None,
) -> bytes:
    """A creds_entry; ``caps``: field number (9 inh, 10 prm, 11 eff, 19 amb) -> 2 words."""
    caps = caps or {}
    out = b"".join(field_varint(n, v) for n, v in zip((1, 3, 5, 7), uids, strict=True))
    out = b"".join([field_varint(n, v) for n, v in zip((2, 4, 6, 8), gids, strict=True)]) + out
    for n in (9, 10, 11, 12, 19):
        for word in caps.get(n, (0xFFFFFFFF, 0x1FF) if n == 12 else (0, 0)):
            out += field_varint(n, word)
    out += field_varint(13, 0)
    for g in groups:
        out += field_varint(14, g)
    return out


def core(task_state: int, creds_entry: bytes | None) -> bytes:
    """A core_entry: mtype x86_64, tc with task_state (and the other required fields),
    thread_core with futex fields and creds."""
    tc = (
        field_varint(1, task_state)
        + field_varint(2, 0)
        + field_varint(3, 0)
        + field_varint(4, 0)
        + field_varint(5, 0)
        + field_bytes(6, b"sleep")
    )
    out = field_varint(1, 1) + field_bytes(3, tc)
    if creds_entry is not None:
        thread_core = field_varint(1, 0) + field_varint(2, 0) + field_bytes(10, creds_entry)
        out += field_bytes(5, thread_core)
    return out


def image_file(magic: int, messages: list[bytes]) -> bytes:
    return struct.pack("<II", IMG_COMMON_MAGIC, magic) + b"".join(
        struct.pack("<I", len(m)) + m for m in messages
    )


def core_img(task_state: int, creds_entry: bytes | None) -> bytes:
    return image_file(CORE_MAGIC, [core(task_state, creds_entry)])


def pstree_img(entries: list[tuple[int, int, list[int]]]) -> bytes:
    """(pid, ppid, threads) per task."""
    msgs = []
    for pid, ppid, threads in entries:
        m = b"".join(field_varint(n, v) for n, v in ((1, pid), (2, ppid), (3, pid), (4, pid)))
        msgs.append(m + b"".join(field_varint(5, t) for t in threads))
    return image_file(PSTREE_MAGIC, msgs)


def mm_img(vmas: list[tuple[int, int, int]], start_stack: int = 0) -> bytes:
    """An mm image: (start, end, status) per area, and mm_start_stack."""
    from spswap.checkpoint.image_layout import MM_MAGIC

    msg = field_varint(5, start_stack)
    for start, end, status in vmas:
        vma = (field_varint(1, start) + field_varint(2, end) + field_varint(3, 0)
               + field_varint(4, 0) + field_varint(5, 3) + field_varint(6, 0x22)
               + field_varint(7, status) + field_varint(8, 1))  # fmt: skip
        msg += field_bytes(14, vma)
    return image_file(MM_MAGIC, [msg])


def pagemap_img(runs: list[tuple[int, int, int | None, bool]]) -> bytes:
    """A pagemap image: its head, then (vaddr, nr_pages, flags or None, in_parent) per run
    (flags None: an old image that says in_parent instead)."""
    from spswap.checkpoint.image_layout import PAGEMAP_MAGIC

    msgs = [field_varint(1, 1)]
    for vaddr, nr_pages, flags, in_parent in runs:
        msg = field_varint(1, vaddr) + field_varint(2, nr_pages)
        if in_parent:
            msg += field_varint(3, 1)
        if flags is not None:
            msg += field_varint(4, flags)
        msgs.append(msg)
    return image_file(PAGEMAP_MAGIC, msgs)
