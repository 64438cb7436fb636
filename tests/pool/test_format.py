"""The safetensors header parser: pure bytes in, tensors or a clear error out."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from spswap.errors import InvalidCheckpoint
from spswap.pool.safetensors_format import parse_header, read_safetensors, resolve_checkpoint

from .st_files import header_and_data, tensors, write_raw, write_sharded, write_st


def _hdr(spec: dict) -> bytes:
    return json.dumps(spec).encode()


def test_parse_header_sorted_by_offset_with_absolute_offsets() -> None:
    h = _hdr(
        {
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
            "a": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]},
            "__metadata__": {"k": "v"},
        }
    )
    got, meta = parse_header(h, 8 + len(h) + 16, name="x")
    assert [(t.name, t.file_offset, t.size_bytes) for t in got] == [
        ("a", 8 + len(h), 8),
        ("b", 8 + len(h) + 8, 8),
    ]
    assert meta == {"k": "v"}


@pytest.mark.parametrize(
    ("spec", "data_bytes", "message"),
    [
        (
            {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
            8,
            "'a' ends at data byte 16 but the file holds only 8 data bytes",
        ),
        (
            {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}},
            16,
            "span 12 bytes but shape [4] of F32 needs 16 (the header lies)",
        ),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            16,
            "tensors 'a' and 'b' overlap",
        ),
        ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, 8, "unknown dtype 'Q4'"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}}, 8, "bad shape"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, 8, "bad data_offsets"),
        ({"a": [1, 2]}, 8, "entry is not a JSON object"),
    ],
)
def test_parse_header_rejects_lies(spec: dict, data_bytes: int, message: str) -> None:
    h = _hdr(spec)
    with pytest.raises(InvalidCheckpoint) as e:
        parse_header(h, 8 + len(h) + data_bytes, name="ckpt.safetensors")
    assert message in str(e.value)
    assert str(e.value).startswith("ckpt.safetensors: ")


def test_parse_header_not_json() -> None:
    with pytest.raises(InvalidCheckpoint, match="header is not valid JSON"):
        parse_header(b"\xff\xfe{", 100, name="x")


def test_read_matches_safetensors_package(tmp_path: Path) -> None:
    arrays = tensors()
    save_file(arrays, str(tmp_path / "m.safetensors"))
    f = read_safetensors(tmp_path / "m.safetensors")
    raw = (tmp_path / "m.safetensors").read_bytes()
    assert {t.name for t in f.tensors} == set(arrays)
    for t in f.tensors:
        assert raw[t.file_offset : t.file_offset + t.size_bytes] == arrays[t.name].tobytes()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "too short to be a safetensors file"),
        (b"hello world, I am a text file\n" * 3, "not a safetensors file"),
        (struct.pack("<Q", 1000) + b"{}", "does not fit"),
        (np.random.default_rng(1).bytes(4096), "not a safetensors file"),
    ],
)
def test_read_rejects_non_safetensors(tmp_path: Path, content: bytes, message: str) -> None:
    p = tmp_path / "x.safetensors"
    p.write_bytes(content)
    with pytest.raises(InvalidCheckpoint, match=message):
        read_safetensors(p)


def test_truncated_file(tmp_path: Path) -> None:
    p = write_st(tmp_path / "m.safetensors", tensors())
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(InvalidCheckpoint, match="truncated, or the header lies"):
        read_safetensors(p)


def test_resolve_file_dir_and_sharded(tmp_path: Path) -> None:
    (tmp_path / "single").mkdir()
    write_st(tmp_path / "single" / "model.safetensors", tensors())
    c = resolve_checkpoint(tmp_path / "single")
    assert c.name == "single" and len(c.files) == 1
    c = resolve_checkpoint(tmp_path / "single" / "model.safetensors")
    assert c.name == "single"
    arrays = tensors()
    names = list(arrays)
    sh = write_sharded(
        tmp_path / "sh", [{k: arrays[k] for k in names[:2]}, {k: arrays[k] for k in names[2:]}]
    )
    c = resolve_checkpoint(sh)
    assert c.name == "sh" and len(c.files) == 2
    assert {t.name for _f, t in c.tensors} == set(arrays)
    assert [s.path for s in c.sources][-1].endswith("model.safetensors.index.json")


def test_resolve_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidCheckpoint, match="no such file or directory"):
        resolve_checkpoint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    write_st(tmp_path / "empty" / "other.safetensors", tensors())
    with pytest.raises(InvalidCheckpoint, match="found other.safetensors: name the file"):
        resolve_checkpoint(tmp_path / "empty")
    arrays = tensors()
    sh = write_sharded(tmp_path / "sh", [arrays])
    (sh / "model-00001-of-00001.safetensors").unlink()
    with pytest.raises(InvalidCheckpoint, match="missing"):
        resolve_checkpoint(sh)
    sh2 = write_sharded(tmp_path / "sh2", [arrays])
    idx = json.loads((sh2 / "model.safetensors.index.json").read_text())
    idx["weight_map"]["ghost"] = "model-00001-of-00001.safetensors"
    (sh2 / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(InvalidCheckpoint, match="'ghost' is mapped to .* but that shard lacks it"):
        resolve_checkpoint(sh2)


def test_header_padding_and_metadata_only(tmp_path: Path) -> None:
    header, data = header_and_data({"a": np.arange(3, dtype=np.int32)})
    p = write_raw(tmp_path / "m.safetensors", header, data)
    assert read_safetensors(p).tensors[0].shape == (3,)
