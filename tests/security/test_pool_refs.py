"""A pool reference that looks like a digest is answered by a digest, never by a name
that another user chose (a user could otherwise name an entry after a prefix of someone
else's digest and hand them her weights)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from spswap import access
from spswap.config import Config
from spswap.daemon.client import Client
from spswap.errors import PoolEntryNotFound
from spswap.pool.layout import MANIFEST_FILE
from spswap.pool.store import Pool
from tests.pool.st_files import tensors, write_st
from tests.security.conftest import as_user, outcome


def _plant(cfg: Config, own: str, planted: str, prefix: str) -> dict[str, Any]:
    return {
        "named": outcome(access.import_model, cfg, own, name=prefix),
        "upper": outcome(access.import_model, cfg, own, name=prefix.upper()),
        # no name given: the file's stem would be the name
        "stem": outcome(access.import_model, cfg, planted),
        "plain": access.import_model(cfg, own, name="mine").digest,
    }


def test_a_name_never_answers_for_a_digest(cfg: Config, daemon: int, user_uid: int) -> None:
    victim = access.import_model(cfg, write_st(cfg.root / "v.safetensors", tensors(11)))
    prefix = victim.digest[:9]
    home = cfg.root / "home"
    home.mkdir(mode=0o700)
    own = write_st(home / "own.safetensors", tensors(12))
    planted = write_st(home / f"{prefix}.safetensors", tensors(13))
    for p in (home, own, planted):
        os.chown(p, user_uid, -1)

    out = as_user(user_uid, _plant, cfg, str(own), str(planted), prefix)

    for key in ("named", "upper", "stem"):
        assert out[key].startswith("PoolError: entry name ") and "looks like a digest" in \
            out[key] and "--name" in out[key], (key, out[key])  # fmt: skip
    got = Client(cfg).call("pool.use", ref=prefix)
    assert got["digest"] == victim.digest
    Client(cfg).call("pool.unuse", ref=prefix)

    # an entry named like that before names were checked: the digest still wins, and the
    # name alone no longer finds it
    pool = Pool.from_config(cfg)
    mpath = pool.entry_dir(out["plain"]) / MANIFEST_FILE
    raw = json.loads(mpath.read_text())
    raw["name"] = prefix
    mpath.write_text(json.dumps(raw))
    assert pool.find(prefix).digest == victim.digest
    raw["name"] = "c0ffee42"
    mpath.write_text(json.dumps(raw))
    with pytest.raises(PoolEntryNotFound, match="look like digests"):
        pool.find("c0ffee42")
    assert pool.find(out["plain"][:8]).digest == out["plain"]
