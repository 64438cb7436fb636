"""``spswap doctor``'s bytecode row: does every spswap module have compiled bytecode that
matches its source?

A site installs spswap as root (``pip install -e``, which compiles nothing), so a user's
``spswap serve`` cannot write ``__pycache__`` there and compiles each of the ~100
modules it imports again at every start: about 0.1 s more on a requeued run's path, of
a kept swap's ~0.7 s (a root-owned copy imported by another user on the CI VM: 270-290
ms without bytecode, 165-195 ms with; the H100's Slurm flow: a run's start to its
reservation 0.30 -> 0.21 s). ``scripts/install.sh`` compiles it; an update of the
checkout makes the bytecode stale again, and bytecode written under a umask of 077 is
root's alone, so this row says when to compile again.
"""

from __future__ import annotations

import importlib.util
import os
import stat
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
    """The package's ``.py`` files without current bytecode that every user can read
    (missing, stale, or not readable by others), and how many ``.py`` files it has."""
    sources = sorted(package_dir.rglob("*.py"))
    stale: list[Path] = []
    for source in sources:
        st = source.stat()
        cached = importlib.util.cache_from_source(str(source))
        try:
            with open(cached, "rb") as f:
                header = f.read(PYC_HEADER_BYTES)
            readable = bool(os.stat(cached).st_mode & stat.S_IROTH)
        except OSError:
            header, readable = b"", False
        if not (readable and pyc_matches(header, int(st.st_mtime), st.st_size)):
            stale.append(source)
    return stale, len(sources)


def bytecode_text(package_dir: Path, stale: int, total: int, python: str) -> tuple[str, str]:
    """The row's value and detail for ``stale`` of ``total`` modules without current
    bytecode. Pure."""
    if stale == 0:
        return f"{total} module{'s' * (total != 1)} compiled ({package_dir})", ""
    return (f"{stale} of {total} modules without current bytecode every user can read "
            f"({package_dir})",
            "users cannot write its __pycache__, so every `spswap serve` compiles them "
            "again at its start (about 0.1 s of each requeued run): run `sudo sh -c 'umask "
            f"022; {python} -m compileall -q -f {package_dir}'` (scripts/install.sh does "
            "it), again after each update of the checkout")  # fmt: skip


def bytecode_check(package_dir: Path | None = None) -> dict[str, Any]:
    """The doctor's row (a warning where any module lacks current bytecode)."""
    package_dir = package_dir or Path(__file__).resolve().parent
    stale, total = stale_modules(package_dir)
    value, detail = bytecode_text(package_dir, len(stale), total, sys.executable)
    return check("bytecode", True if not stale else None, value, detail)
