"""``spswap pool`` through the real typer app: exit codes, messages and exact JSON keys."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from spswap.cli.app import app

from .st_files import tensors, write_st

IMPORT_KEYS = {
    "name",
    "digest",
    "path",
    "data_size_bytes",
    "tensor_count",
    "seconds",
    "bytes_per_s",
    "reused",
}
ENTRY_KEYS = {
    "name",
    "digest",
    "path",
    "size_bytes",
    "data_size_bytes",
    "tensor_count",
    "created",
    "last_used",
    "users",
    "importers",
    "sources",
    "identity",
}


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPSWAP_ROOT", str(tmp_path / "root"))
    monkeypatch.setenv("SPSWAP_POOL_CAPACITY_BYTES", "64M")
    return tmp_path


def _run(*args: str) -> tuple[int, str, Exception | None]:
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.stdout, r.exception


def test_import_ls_verify_rm(env: Path) -> None:
    src = write_st(env / "tiny.safetensors", tensors())
    code, out, _ = _run("pool", "import", str(src), "--json")
    assert code == 0
    imported = json.loads(out)
    assert set(imported) == IMPORT_KEYS and imported["reused"] is False
    assert imported["name"] == "tiny" and imported["tensor_count"] == 5
    code, out, _ = _run("pool", "import", str(src), "--json")
    assert json.loads(out)["reused"] is True

    code, out, _ = _run("pool", "ls", "--json")
    listing = json.loads(out)
    assert code == 0 and set(listing) == {
        "pool",
        "capacity_bytes",
        "used_bytes",
        "user_budget_bytes",
        "yours_bytes",
        "entries",
    }
    assert listing["capacity_bytes"] == 64 << 20
    (entry,) = listing["entries"]
    assert set(entry) == ENTRY_KEYS and entry["digest"] == imported["digest"]

    code, out, _ = _run("pool", "ls")
    assert code == 0 and "tiny" in out and imported["digest"][:12] in out

    code, out, _ = _run("pool", "verify", "tiny", "--json")
    assert code == 0
    verified = json.loads(out)
    # the text's count and rate, named as import's are
    assert verified.pop("seconds") >= 0 and verified.pop("bytes_per_s") > 0
    assert verified == {
        "name": "tiny",
        "digest": imported["digest"],
        "ok": True,
        "bad_tensor": None,
        "error": None,
        "tensor_count": 5,
        "data_size_bytes": imported["data_size_bytes"],
    }
    code, out, _ = _run("pool", "rm", imported["digest"][:8])
    assert code == 0 and "removed tiny" in out
    assert json.loads(_run("pool", "ls", "--json")[1])["entries"] == []


def test_verify_names_bad_tensor(env: Path) -> None:
    src = write_st(env / "tiny.safetensors", tensors())
    digest = json.loads(_run("pool", "import", str(src), "--json")[1])["digest"]
    data = env / "root" / "pool" / digest / "data.bin"
    manifest = json.loads((data.parent / "manifest.json").read_text())
    t = next(t for t in manifest["tensors"] if t["name"] == "embed.weight")
    with open(data, "r+b") as f:
        f.seek(t["offset"] + 5)
        f.write(b"\xff\xfe")
    code, out, _ = _run("pool", "verify", digest[:10], "--json")
    got = json.loads(out)
    assert code == 1 and got["ok"] is False and got["bad_tensor"] == "embed.weight"
    assert got["error"]["kind"] == "PoolCorrupt" and got["error"]["exit_code"] == 1
    assert "'embed.weight'" in got["error"]["message"] and got["users"] == []
    assert got["error"]["message"].endswith(
        f"remove it as root (spswap pool rm {digest[:12]}); the next job that runs the model "
        "imports it again from its files"
    )
    # and the one line on stderr, as for any failure (it was missing under --json)
    r = CliRunner().invoke(app, ["pool", "verify", digest[:10], "--json"])
    assert ": error: pool entry tiny" in r.stderr and "'embed.weight'" in r.stderr
    code, _out, exc = _run("pool", "verify", digest[:10])
    assert code == 1 and "'embed.weight'" in str(exc)


def test_errors_exit_nonzero_with_message(env: Path) -> None:
    code, _, exc = _run("pool", "import", str(env / "missing"))
    assert code == 1 and "no such file or directory" in str(exc)
    code, _, exc = _run("pool", "rm", "nothing-here")
    assert code == 1 and "spswap pool import PATH" in str(exc)
    assert not os.path.exists(env / "root" / "pool" / "index.json")


def test_help_explains() -> None:
    code, out, _ = _run("pool", "--help")
    assert code == 0
    for cmd in ("import", "ls", "rm", "verify"):
        assert cmd in out
