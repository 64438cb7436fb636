"""``spswap doctor``'s bytecode row: does every spswap module have compiled bytecode that
matches its source?

A site installs spswap as root (``pip install -e``, which compiles nothing), so a user's
``spswap serve`` cannot write ``__pycache__`` there and compiles each of the ~100
modules it imports again at every start: 0.1-0.2 s more on a requeued run's path, of a
kept swap's half second (a root-owned copy on the CI VM: 240-350 ms of imports without
bytecode, 170-185 ms with; the H100's Slurm flow: a run's start to its reservation 0.30
-> 0.21 s). ``scripts/install.sh`` compiles it; an update of the checkout makes the
bytecode stale again, so this row says when to compile.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from spswap.doctor_check import check

PYC_HEADER_BYTES = 16  # magic, flags, then the source's mtime and size (PEP 552)


def pyc_matches(header: bytes, source_mtime_s: int, source_size_bytes: int,
                magic: bytes = importlib.util.MAGIC_NUMBER) -> bool:  # fmt: skip
    """Whether a ``.pyc``'s first 16 bytes say it was compiled, by this Python, from a
    source of this mtime and size (as the import system checks). Hash-based bytecode
    (flags != 0) counts as current: the import system checks it, or trusts it, itself.
    Pure.

    >>> import struct
    >>> head = importlib.util.MAGIC_NUMBER + struct.pack("<III", 0, 1700000000, 120)
    >>> pyc_matches(head, 1700000000, 120), pyc_matches(head, 1700000001, 120)
    (True, False)
    """
    if len(header) < PYC_HEADER_BYTES or header[:4] != magic:
        return False
    if int.from_bytes(header[4:8], "little") != 0:
        return True
    mtime = int.from_bytes(header[8:12], "little")
    size = int.from_bytes(header[12:16], "little")
    return mtime == source_mtime_s & 0xFFFFFFFF and size == source_size_bytes & 0xFFFFFFFF


def stale_modules(package_dir: Path) -> tuple[list[Path], int]:
    """The package's ``.py`` files without current bytecode (missing or stale), and how
    many ``.py`` files it has."""
    sources = sorted(package_dir.rglob("*.py"))
    stale: list[Path] = []
    for source in sources:
        st = source.stat()
        try:
            with open(importlib.util.cache_from_source(str(source)), "rb") as f:
                header = f.read(PYC_HEADER_BYTES)
        except OSError:
            header = b""
        if not pyc_matches(header, int(st.st_mtime), st.st_size):
            stale.append(source)
    return stale, len(sources)


def bytecode_text(package_dir: Path, stale: int, total: int, python: str) -> tuple[str, str]:
    """The row's value and detail for ``stale`` of ``total`` modules without current
    bytecode. Pure."""
    if stale == 0:
        return f"{total} module{'s' * (total != 1)} compiled ({package_dir})", ""
    return (f"{stale} of {total} modules without current bytecode ({package_dir})",
            "users cannot write its __pycache__, so every `spswap serve` compiles them "
            "again at its start (0.1-0.2 s of each requeued run): run `sudo "
            f"{python} -m compileall -q {package_dir}` (scripts/install.sh does it), "
            "again after each update of the checkout")  # fmt: skip


def bytecode_check(package_dir: Path | None = None) -> dict[str, Any]:
    """The doctor's row (a warning where any module lacks current bytecode)."""
    package_dir = package_dir or Path(__file__).resolve().parent
    stale, total = stale_modules(package_dir)
    value, detail = bytecode_text(package_dir, len(stale), total, sys.executable)
    return check("bytecode", True if not stale else None, value, detail)
