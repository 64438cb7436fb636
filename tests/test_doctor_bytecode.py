"""spswap doctor's bytecode row: a module without current bytecode is compiled again by
every user's `spswap serve` where users cannot write __pycache__ (a root install)."""

from __future__ import annotations

import compileall
import importlib.util
import os
import struct
import sys
from pathlib import Path

from spswap.doctor_bytecode import bytecode_check, bytecode_text, pyc_matches, stale_modules

MAGIC = importlib.util.MAGIC_NUMBER


def _header(flags: int, mtime_s: int, size_bytes: int, magic: bytes = MAGIC) -> bytes:
    return magic + struct.pack("<III", flags, mtime_s, size_bytes)


def test_a_pyc_matches_only_this_python_s_magic_and_the_source_s_mtime_and_size() -> None:
    assert pyc_matches(_header(0, 1700000000, 120), 1700000000, 120) is True
    assert pyc_matches(_header(0, 1700000000, 120), 1700000001, 120) is False
    assert pyc_matches(_header(0, 1700000000, 120), 1700000000, 121) is False
    assert pyc_matches(_header(0, 1700000000, 120, magic=b"\x00\x00\r\n"), 1700000000, 120) is False
    assert pyc_matches(_header(0, 1700000000, 120)[:12], 1700000000, 120) is False
    assert pyc_matches(b"", 1700000000, 120) is False
    # hash-based bytecode: the import system checks (or trusts) it itself
    assert pyc_matches(_header(3, 0, 0), 1700000000, 120) is True
    # mtimes and sizes past 32 bits are kept modulo 2**32, as the import system does
    assert pyc_matches(_header(0, 5, 7), 2**32 + 5, 2**32 + 7) is True


def test_stale_modules_are_the_uncompiled_and_the_changed_ones(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for rel in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py"):
        (pkg / rel).write_text("X = 1\n")
    stale, total = stale_modules(pkg)
    assert total == 4 and len(stale) == 4
    assert compileall.compile_dir(str(pkg), quiet=1)
    assert stale_modules(pkg) == ([], 4)
    b = pkg / "sub" / "b.py"
    b.write_text("X = 22\n")  # an update of the checkout: another size
    os.utime(b, (1700000000, 1700000000))
    assert stale_modules(pkg) == ([b], 4)
    compileall.compile_dir(str(pkg), quiet=1)
    a_pyc = Path(importlib.util.cache_from_source(str(pkg / "a.py")))
    a_pyc.chmod(0o600)  # compiled under umask 077: current, but root's alone (a walk's find)
    assert stale_modules(pkg) == ([pkg / "a.py"], 4)
    umask = os.umask(0o022)  # the row's command: umask 022, compileall -f
    try:
        assert compileall.compile_dir(str(pkg), quiet=1, force=True)
    finally:
        os.umask(umask)
    assert stale_modules(pkg) == ([], 4)


def test_the_row_says_how_many_and_the_command_that_compiles_them() -> None:
    assert bytecode_text(Path("/opt/spswap/spswap"), 0, 198, "/v/bin/python") == (
        "198 modules compiled (/opt/spswap/spswap)",
        "",
    )
    assert bytecode_text(Path("/opt/spswap/spswap"), 26, 198, "/v/bin/python") == (
        "26 of 198 modules without current bytecode every user can read (/opt/spswap/spswap)",
        "users cannot write its __pycache__, so every `spswap serve` compiles them again at "
        "its start (about 0.1 s of each requeued run): run `sudo sh -c 'umask 022; "
        "/v/bin/python -m compileall -q -f /opt/spswap/spswap'` (scripts/install.sh does "
        "it), again after each update of the checkout",
    )  # fmt: skip


def test_the_row_warns_until_the_package_is_compiled(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("X = 1\n")
    row = bytecode_check(pkg)
    assert row["name"] == "bytecode" and row["ok"] is None and "compileall" in row["detail"]
    assert sys.executable in row["detail"]
    compileall.compile_dir(str(pkg), quiet=1)
    assert bytecode_check(pkg) == {
        "name": "bytecode", "ok": True, "required": False,
        "value": f"1 module compiled ({pkg})", "detail": "",
    }  # fmt: skip
