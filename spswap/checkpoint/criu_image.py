"""A small pure reader of CRIU's image format (no ``crit``/pycriu: CRIU's bundle ships
neither): an image file is a little-endian u32 magic (most files have the common magic
first, then their own), then entries, each a u32 length and a protobuf message.
Unknown fields are skipped by wire type, as protobuf does. Used by :mod:`image_creds`
(the credentials an image restores) and :mod:`image_layout` (what its memory is).
"""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

from spswap.errors import ImageUnreadable

IMG_COMMON_MAGIC = 0x54564319


def varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The protobuf varint at ``pos``: (its value, the position after it)."""
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ImageUnreadable("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ImageUnreadable("varint too long")


def fields(msg: bytes) -> list[tuple[int, int, int | bytes]]:
    """A protobuf message's fields in order: (number, wire type, value): an int for
    varints and fixed ints, bytes for length-delimited ones."""
    out: list[tuple[int, int, int | bytes]] = []
    pos = 0
    while pos < len(msg):
        key, pos = varint(msg, pos)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, pos = varint(msg, pos)
        elif wire == 1:
            if pos + 8 > len(msg):
                raise ImageUnreadable("truncated fixed64")
            value, pos = struct.unpack_from("<Q", msg, pos)[0], pos + 8
        elif wire == 2:
            size, pos = varint(msg, pos)
            if pos + size > len(msg):
                raise ImageUnreadable("truncated field")
            value, pos = msg[pos : pos + size], pos + size
        elif wire == 5:
            if pos + 4 > len(msg):
                raise ImageUnreadable("truncated fixed32")
            value, pos = struct.unpack_from("<I", msg, pos)[0], pos + 4
        else:
            raise ImageUnreadable(f"wire type {wire} (field {number}) is not supported")
        out.append((number, wire, value))
    return out


def entries(data: bytes, magic: int) -> list[bytes]:
    """The messages of an image file whose own magic is ``magic``."""
    if len(data) < 4:
        raise ImageUnreadable("shorter than a magic")
    pos = 0
    (first,) = struct.unpack_from("<I", data, 0)
    pos = 4
    if first == IMG_COMMON_MAGIC:
        if len(data) < 8:
            raise ImageUnreadable("no magic after the common one")
        (first,) = struct.unpack_from("<I", data, 4)
        pos = 8
    if first != magic:
        raise ImageUnreadable(f"magic {first:#x}, expected {magic:#x}")
    out = []
    while pos < len(data):
        if pos + 4 > len(data):
            raise ImageUnreadable("truncated entry size")
        (size,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if pos + size > len(data):
            raise ImageUnreadable("truncated entry")
        out.append(data[pos : pos + size])
        pos += size
    return out


# mm, pagemap, core and pstree files are kilobytes to a few MiB (a pagemap entry per run
# of pages): far more than that is not an image CRIU wrote
MAX_IMAGE_FILE_BYTES = 64 << 20


def read_image_file(path: Path, max_bytes: int = MAX_IMAGE_FILE_BYTES) -> bytes:
    """One of an image's small files, read by root from a directory the job's user's CRIU
    wrote: a link, a FIFO, a device or an outsized file is refused (ImageUnreadable),
    never followed, waited on or read whole."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ImageUnreadable(f"cannot read {path.name}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageUnreadable(f"{path.name} is not a regular file")
        if st.st_size > max_bytes:
            raise ImageUnreadable(f"{path.name} holds {st.st_size} bytes, more than an "
                                  f"image file of its kind ({max_bytes})")  # fmt: skip
        return f.read(max_bytes + 1)[:max_bytes]
