"""The staged copy's plan: the entry's data cut into pieces that take the device staging
buffers in turn, and where each piece's bytes land in the tensors. Pure (the manifest
alone): :class:`~spswap.transfer.mapping.MappedEntry` keeps the plan it made for each
piece size, so a wake does not plan again (the plan is made inside the timed copy).
"""

from __future__ import annotations

from dataclasses import dataclass

from spswap.errors import TransferError
from spswap.pool.manifest import Manifest


@dataclass(frozen=True)
class Piece:
    """One staged piece: bytes ``[start, end)`` of the entry's data go host -> staging
    buffer ``buffer``; then each ``(name, tensor_offset, buffer_offset, size)`` slice goes
    buffer -> that tensor's bytes."""

    start: int
    end: int
    buffer: int
    slices: tuple[tuple[str, int, int, int], ...]


def staging_plan(manifest: Manifest, piece_bytes: int, buffers: int = 2,
                 skip: frozenset[str] = frozenset()) -> list[Piece]:  # fmt: skip
    """Cut the entry's data into pieces of ``piece_bytes`` (alignment gaps between tensors
    are skipped, tensors are split across pieces), the pieces taking the ``buffers``
    staging buffers in turn. Pure: the plan :func:`spswap.transfer.copy.copy_into` follows with
    ``staging_bytes``; every byte of a tensor not named in ``skip`` lands in exactly one
    slice, and no piece carries a byte of a tensor of ``skip`` (a skipped tensor ends the
    piece before it)."""
    if piece_bytes <= 0:
        raise TransferError(f"staging piece size must be positive, not {piece_bytes}")
    pieces: list[Piece] = []
    slices: list[tuple[str, int, int, int]] = []
    start = end = -1

    def close() -> None:
        if slices:
            pieces.append(Piece(start, end, len(pieces) % buffers, tuple(slices)))
            slices.clear()

    for t in sorted(manifest.tensors, key=lambda t: t.offset):
        if t.name in skip:
            close()
            continue
        done = 0
        while done < t.size_bytes:
            at = t.offset + done
            if slices and (at - start >= piece_bytes):
                close()
            if not slices:
                start = at
            n = min(t.size_bytes - done, start + piece_bytes - at)
            slices.append((t.name, done, at - start, n))
            end = at + n
            done += n
    close()
    return pieces
