"""A pool entry's manifest: what each tensor is and where its bytes lie.

An entry is a directory ``$SPSWAP_ROOT/pool/<digest>/`` holding ``manifest.json`` and
one flat data file, ``data.bin``, in which every tensor starts at a multiple of
:data:`ALIGNMENT_BYTES` (so a registered mapping can feed DMA copies directly).
Pure data: no torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from spswap.errors import PoolCorrupt
from spswap.pool.layout import DATA_FILE

MANIFEST_VERSION = 1
ALIGNMENT_BYTES = 4096

# safetensors dtype name -> bytes per element
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


def align_up(offset: int, alignment: int = ALIGNMENT_BYTES) -> int:
    """The first multiple of ``alignment`` at or after ``offset``."""
    return (offset + alignment - 1) // alignment * alignment


def padded_size_bytes(sizes: Iterable[int]) -> int:
    """Size of a data file holding tensors of ``sizes`` bytes, each on an aligned offset:
    what :meth:`Pool.writer` wants as ``expected_size_bytes``."""
    return sum(align_up(s) for s in sizes)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor in the data file."""

    name: str
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # byte offset in data.bin, a multiple of ALIGNMENT_BYTES
    size_bytes: int
    checksum: str  # "sha256:<hex>" of the tensor's bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "dtype": self.dtype, "shape": list(self.shape),
            "offset": self.offset, "size_bytes": self.size_bytes, "checksum": self.checksum,
        }  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TensorEntry:
        return cls(
            name=str(d["name"]), dtype=str(d["dtype"]), shape=tuple(int(x) for x in d["shape"]),
            offset=int(d["offset"]), size_bytes=int(d["size_bytes"]), checksum=str(d["checksum"]),
        )  # fmt: skip


@dataclass(frozen=True)
class SourceFile:
    """A file the entry was imported from, as it was when read."""

    path: str
    size_bytes: int
    mtime_ns: int

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size_bytes": self.size_bytes, "mtime_ns": self.mtime_ns}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SourceFile:
        return cls(
            path=str(d["path"]), size_bytes=int(d["size_bytes"]), mtime_ns=int(d["mtime_ns"])
        )


@dataclass(frozen=True)
class Manifest:
    """Everything known about one pool entry."""

    name: str
    digest: str  # content digest: names, dtypes, shapes and checksums of every tensor
    data_size_bytes: int
    tensors: tuple[TensorEntry, ...]
    sources: tuple[SourceFile, ...] = ()
    created: float = 0.0
    # Free-form identity of where the layout came from (e.g. the engine that exported
    # it: {"engine": "vllm", "version": "0.26.0", "tp": 1}); empty for plain imports.
    identity: dict[str, Any] = field(default_factory=dict)
    alignment_bytes: int = ALIGNMENT_BYTES
    version: int = MANIFEST_VERSION

    @property
    def tensor_bytes(self) -> int:
        return sum(t.size_bytes for t in self.tensors)

    def by_name(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version, "name": self.name, "digest": self.digest,
            "data_file": DATA_FILE, "data_size_bytes": self.data_size_bytes,
            "alignment_bytes": self.alignment_bytes, "created": self.created,
            "identity": self.identity,
            "sources": [s.to_json() for s in self.sources],
            "tensors": [t.to_json() for t in self.tensors],
        }  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Manifest:
        if d.get("version") != MANIFEST_VERSION:
            raise PoolCorrupt(
                f"manifest version {d.get('version')!r} is not {MANIFEST_VERSION}: the entry "
                f"was written by another spswap; remove it (spswap pool rm) and import again"
            )
        return cls(
            name=str(d["name"]), digest=str(d["digest"]),
            data_size_bytes=int(d["data_size_bytes"]),
            tensors=tuple(TensorEntry.from_json(t) for t in d["tensors"]),
            sources=tuple(SourceFile.from_json(s) for s in d.get("sources", [])),
            created=float(d.get("created", 0.0)), identity=dict(d.get("identity", {})),
            alignment_bytes=int(d.get("alignment_bytes", ALIGNMENT_BYTES)),
        )  # fmt: skip


def content_digest(tensors: list[TensorEntry] | tuple[TensorEntry, ...]) -> str:
    """Digest over names, dtypes, shapes and checksums, in name order (offsets excluded)."""
    h = hashlib.sha256()
    for t in sorted(tensors, key=lambda t: t.name):
        h.update(f"{t.name}\0{t.dtype}\0{','.join(map(str, t.shape))}\0{t.checksum}\n".encode())
    return h.hexdigest()
