"""Read and validate safetensors checkpoints without torch or the safetensors package.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``)
and the raw tensor bytes, offsets counted from the end of the header.

Everything here only reads headers: no tensor data is touched, so resolving even a
100 GB checkpoint costs a few small reads. :func:`parse_header` is a pure function
(bytes in, data out) and carries all the checks; the rest finds and opens files.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spswap.errors import InvalidCheckpoint
from spswap.pool.manifest import DTYPE_SIZES, SourceFile

HEADER_LEN_BYTES = 8
# The reference implementation refuses headers above 100 MB; so do we.
MAX_HEADER_BYTES = 100 * 1000 * 1000
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_FIX = (
    "re-download or re-save the checkpoint "
    "(e.g. model.save_pretrained(..., safe_serialization=True))"
)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file, as its header describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file_offset: int  # absolute byte offset of the first byte in the file
    size_bytes: int


@dataclass(frozen=True)
class SafetensorsFile:
    """A validated safetensors file: its header, tensors and stat at the time of reading."""

    path: Path
    size_bytes: int
    mtime_ns: int
    data_start: int  # 8 + header length
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str]

    @property
    def source(self) -> SourceFile:
        return SourceFile(path=str(self.path), size_bytes=self.size_bytes, mtime_ns=self.mtime_ns)


@dataclass(frozen=True)
class Checkpoint:
    """A resolved checkpoint: one or more validated files plus the files that describe them."""

    path: Path  # what the user named, resolved
    name: str  # default pool entry name
    files: tuple[SafetensorsFile, ...]
    extra_sources: tuple[SourceFile, ...] = ()  # e.g. model.safetensors.index.json

    @property
    def tensors(self) -> list[tuple[SafetensorsFile, TensorInfo]]:
        return [(f, t) for f in self.files for t in f.tensors]

    @property
    def tensor_bytes(self) -> int:
        return sum(t.size_bytes for f in self.files for t in f.tensors)

    @property
    def sources(self) -> tuple[SourceFile, ...]:
        return tuple(sorted([f.source for f in self.files] + list(self.extra_sources),
                            key=lambda s: s.path))  # fmt: skip


def _bad(name: str, problem: str, fix: str = _FIX) -> InvalidCheckpoint:
    return InvalidCheckpoint(f"{name}: {problem}; {fix}")


def parse_header_length(prefix: bytes, file_size: int, *, name: str) -> int:
    """The JSON header's length from the first 8 bytes, checked against the file size."""
    if file_size < HEADER_LEN_BYTES or len(prefix) < HEADER_LEN_BYTES:
        raise _bad(name, f"only {file_size} bytes, too short to be a safetensors file")
    (header_len,) = struct.unpack("<Q", prefix[:HEADER_LEN_BYTES])
    if header_len < 2 or header_len > MAX_HEADER_BYTES:
        raise _bad(name, f"not a safetensors file (header length field reads {header_len})",
                   "check that the path names a .safetensors file")  # fmt: skip
    if HEADER_LEN_BYTES + header_len > file_size:
        raise _bad(name, f"header of {header_len} bytes does not fit in a {file_size}-byte file "
                   "(truncated, or not a safetensors file)")  # fmt: skip
    return int(header_len)


def parse_header(
    header: bytes, file_size: int, *, name: str
) -> tuple[tuple[TensorInfo, ...], dict[str, str]]:
    """Validate a JSON header against the size of its file; tensors sorted by offset.

    Checks: valid UTF-8 JSON object; every tensor has a known dtype, a shape of
    non-negative ints and ``data_offsets`` whose span equals ``prod(shape) * itemsize``,
    lying inside the file; no two tensors overlap.
    """
    data_start = HEADER_LEN_BYTES + len(header)
    data_bytes = file_size - data_start
    try:
        obj = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        problem = f"header is not valid JSON ({e}); not a safetensors file or corrupt"
        raise _bad(name, problem) from None
    if not isinstance(obj, dict):
        raise _bad(name, "header is not a JSON object; not a safetensors file")
    meta_raw = obj.pop("__metadata__", None) or {}
    if not isinstance(meta_raw, dict):
        raise _bad(name, "__metadata__ is not a JSON object")
    metadata = {str(k): str(v) for k, v in meta_raw.items()}
    tensors = [_tensor_info(tname, spec, data_start, name=name) for tname, spec in obj.items()]
    tensors.sort(key=lambda t: (t.file_offset, t.size_bytes))
    prev: TensorInfo | None = None
    for t in tensors:
        end = t.file_offset - data_start + t.size_bytes
        if end > data_bytes:
            raise _bad(name, f"tensor {t.name!r} ends at data byte {end} but the file holds only "
                       f"{data_bytes} data bytes (truncated, or the header lies)")  # fmt: skip
        if prev is not None and t.file_offset < prev.file_offset + prev.size_bytes and t.size_bytes:
            raise _bad(name, f"tensors {prev.name!r} and {t.name!r} overlap in the file "
                       "(corrupt header)")  # fmt: skip
        if t.size_bytes:
            prev = t
    return tuple(tensors), metadata


def _tensor_info(tname: str, spec: Any, data_start: int, *, name: str) -> TensorInfo:
    if not isinstance(spec, dict):
        raise _bad(name, f"tensor {tname!r}: entry is not a JSON object")
    dtype = spec.get("dtype")
    if dtype not in DTYPE_SIZES:
        known = ", ".join(DTYPE_SIZES)
        raise _bad(name, f"tensor {tname!r} has unknown dtype {dtype!r} (known: {known})",
                   "convert the checkpoint to a supported dtype")  # fmt: skip
    shape = spec.get("shape")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise _bad(name, f"tensor {tname!r} has a bad shape {shape!r}")
    offsets = spec.get("data_offsets")
    if (
        not isinstance(offsets, list) or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):  # fmt: skip
        raise _bad(name, f"tensor {tname!r} has bad data_offsets {offsets!r}")
    size_bytes = math.prod(shape) * DTYPE_SIZES[dtype]
    if offsets[1] - offsets[0] != size_bytes:
        span = offsets[1] - offsets[0]
        raise _bad(name, f"tensor {tname!r}: data_offsets span {span} bytes but shape "
                   f"{shape} of {dtype} needs {size_bytes} (the header lies)")  # fmt: skip
    return TensorInfo(tname, dtype, tuple(shape), data_start + offsets[0], size_bytes)


def read_safetensors(path: Path) -> SafetensorsFile:
    """Open ``path``, read and validate its header (not its data)."""
    name = str(path)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            header_len = parse_header_length(f.read(HEADER_LEN_BYTES), st.st_size, name=name)
            header = f.read(header_len)
    except FileNotFoundError:
        raise _bad(name, "no such file", "check the path") from None
    except IsADirectoryError:
        fix = "name a .safetensors file or a checkpoint directory"
        raise _bad(name, "is a directory", fix) from None
    except PermissionError:
        raise _bad(name, "permission denied", "make it readable for this user") from None
    if len(header) != header_len:
        raise _bad(name, "file shrank while its header was read")
    tensors, metadata = parse_header(header, st.st_size, name=name)
    return SafetensorsFile(path, st.st_size, st.st_mtime_ns, HEADER_LEN_BYTES + header_len,
                           tensors, metadata)  # fmt: skip


def resolve_checkpoint(path: Path) -> Checkpoint:
    """A checkpoint from a ``.safetensors`` file, or a directory holding ``model.safetensors``
    or ``model.safetensors.index.json`` plus its shards. All headers are validated."""
    given = str(path)
    path = Path(os.path.abspath(path))
    if not path.exists():
        raise InvalidCheckpoint(f"{given}: no such file or directory; check the path")
    path = path.resolve()
    if path.is_file():
        stem = path.parent.name if path.stem == "model" else path.stem
        if path.name == INDEX_FILE:
            return _resolve_sharded(path, path.parent.name)
        return Checkpoint(path, stem or "model", (read_safetensors(path),))
    if (path / INDEX_FILE).is_file():
        return _resolve_sharded(path / INDEX_FILE, path.name)
    if (path / SINGLE_FILE).is_file():
        return Checkpoint(path, path.name, (read_safetensors(path / SINGLE_FILE),))
    found = sorted(p.name for p in path.glob("*.safetensors"))[:5]
    hint = f" (found {', '.join(found)}: name the file itself)" if found else ""
    raise InvalidCheckpoint(
        f"{given}: directory has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}; "
        "point at a Hugging Face style safetensors checkpoint"
    )


def _resolve_sharded(index_path: Path, name: str) -> Checkpoint:
    where = str(index_path)
    try:
        st = index_path.stat()
        obj = json.loads(index_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(where, f"cannot read the index ({e})") from None
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise _bad(where, "has no weight_map (tensor name -> shard file)")
    shard_names = sorted({str(v) for v in weight_map.values()})
    shards: list[SafetensorsFile] = []
    for shard in shard_names:
        shard_path = (index_path.parent / shard).resolve()
        if index_path.parent.resolve() not in shard_path.parents:
            raise _bad(where, f"shard {shard!r} lies outside the checkpoint directory")
        if not shard_path.is_file():
            raise _bad(where, f"shard {shard} listed in the weight_map is missing",
                       "finish the download (all shards must be present)")  # fmt: skip
        shards.append(read_safetensors(shard_path))
    by_shard = {s.path.name: {t.name for t in s.tensors} for s in shards}
    for tensor, shard in weight_map.items():
        if tensor not in by_shard[Path(str(shard)).name]:
            raise _bad(where, f"tensor {tensor!r} is mapped to {shard} but that shard lacks it")
    seen: dict[str, str] = {}
    for s in shards:
        for t in s.tensors:
            if t.name in seen:
                raise _bad(where, f"tensor {t.name!r} is in both {seen[t.name]} and {s.path.name}")
            seen[t.name] = s.path.name
    index_src = SourceFile(str(index_path.resolve()), st.st_size, st.st_mtime_ns)
    return Checkpoint(index_path.parent.resolve(), name, tuple(shards), (index_src,))
