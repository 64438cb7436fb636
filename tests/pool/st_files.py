"""Helpers that write real safetensors files (by hand, so headers can lie) and inspect pools."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from spswap.fsutil import read_json

NP_DTYPES = {
    np.dtype("float32"): "F32",
    np.dtype("float16"): "F16",
    np.dtype("int64"): "I64",
    np.dtype("int32"): "I32",
    np.dtype("uint8"): "U8",
    np.dtype("float64"): "F64",
}


def tensors(seed: int = 0, *, scale: int = 1) -> dict[str, np.ndarray]:
    """A small model's worth of tensors with awkward sizes (not multiples of 4096)."""
    rng = np.random.default_rng(seed)
    return {
        "embed.weight": rng.standard_normal((37 * scale, 64)).astype(np.float32),
        "layers.0.bias": rng.standard_normal(13).astype(np.float16),
        "layers.0.weight": rng.standard_normal((64, 33 * scale)).astype(np.float32),
        "step": np.array([7], dtype=np.int64),
        "empty": np.zeros((0, 5), dtype=np.float32),
    }


def header_and_data(arrays: dict[str, np.ndarray]) -> tuple[dict[str, Any], bytes]:
    header: dict[str, Any] = {"__metadata__": {"format": "np"}}
    data = b""
    for name, a in arrays.items():
        raw = np.ascontiguousarray(a).tobytes()
        header[name] = {
            "dtype": NP_DTYPES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    return header, data


def write_raw(path: Path, header: dict[str, Any], data: bytes) -> Path:
    hbytes = json.dumps(header).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    path.write_bytes(struct.pack("<Q", len(hbytes)) + hbytes + data)
    return path


def write_st(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    header, data = header_and_data(arrays)
    return write_raw(path, header, data)


def write_sharded(dirpath: Path, shards: list[dict[str, np.ndarray]]) -> Path:
    dirpath.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, arrays in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_st(dirpath / fname, arrays)
        weight_map.update({name: fname for name in arrays})
    (dirpath / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    return dirpath


def pool_snapshot(pool_dir: Path) -> tuple[list[str], Any]:
    """Visible state of a pool directory: its children (minus the lock dir) and index.json."""
    if not pool_dir.exists():
        return [], None
    names = sorted(p.name for p in pool_dir.iterdir() if p.name != ".locks")
    return names, read_json(pool_dir / "index.json")


def spawn_python(code: str, *args: str) -> subprocess.Popen[str]:
    """A real separate Python process running ``code`` with ``args`` in sys.argv[1:]."""
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
