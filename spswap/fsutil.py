"""Small file helpers shared by the pool, the slot table and the image cache.

State files are versioned JSON, written to a temporary file in the same directory,
fsync'ed and renamed over the old one, so a reader sees the old or the new state and
never half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from spswap.errors import SpswapError

STATE_VERSION = 1


def atomic_write_bytes(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically (same directory temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_json(path: Path, obj: Any, *, mode: int = 0o644) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode(), mode=mode)


def read_json(path: Path, *, default: Any = None) -> Any:
    """Read a JSON file; ``default`` when it does not exist.

    A file that exists but does not parse is an error that names the file, since the
    state it held can't be trusted any more.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return default
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SpswapError(
            f"{path} is not valid JSON ({e}); move it aside and run the command again"
        ) from None


def dir_size_bytes(path: Path) -> int:
    """Total size of the regular files below ``path``."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass
    return total
