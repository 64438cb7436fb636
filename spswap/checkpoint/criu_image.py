"""A small pure reader of CRIU's image format (no ``crit``/pycriu: CRIU's bundle ships
neither): an image file is a little-endian u32 magic (most files have the common magic
first, then their own), then entries, each a u32 length and a protobuf message.
Unknown fields are skipped by wire type, as protobuf does. Used by :mod:`image_creds`
(the credentials an image restores) and :mod:`image_layout` (what its memory is).
"""

from __future__ import annotations

import struct

from spswap.errors import ImageUnreadable

IMG_COMMON_MAGIC = 0x54564319


def varint(buf: bytes, pos: int) -> tuple[int, int]:
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
