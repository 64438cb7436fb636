"""Each user's share of the pool through a real spswapd, as two second uids: one user's
imports cannot evict root's or another user's weights to hold more than their share
(SPSWAP_POOL_USER_BYTES), and one user cannot grow the pool's use records without bound.

Before the share, the pool made room for any import from the least recently used entry
no job used, whoever imported it: a user importing models one after another evicted
the others' entries (the first assertion on root's entry fails there), and every
pool.use added a record to the index every pool op reads.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spswap import access
from spswap.config import Config
from spswap.daemon import events, lifecycle
from spswap.daemon.client import Client
from spswap.pool.index import MAX_USES_PER_USER
from spswap.pool.store import Pool
from tests.pool.st_files import tensors, write_st
from tests.security.conftest import outcome, spawn_as
from tests.uids import node_root


@pytest.fixture
def entry_bytes(tmp_path: Path) -> int:
    probe = Pool(tmp_path / "probe")
    probe.import_checkpoint(write_st(tmp_path / "p.safetensors", tensors(99)), name="p99")
    return probe.entries()[0].size_bytes


@pytest.fixture
def cfg(entry_bytes: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[Config]:
    # room for 4.5 entries; each user's share 2.5 of them
    env = {"SPSWAP_GPUS": "0", "SPSWAP_POOL_CAPACITY_BYTES": str(9 * entry_bytes // 2),
           "SPSWAP_POOL_USER_BYTES": str(5 * entry_bytes // 2)}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # the daemon inherits them
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with node_root("spshare-", env) as cfg:
        lifecycle.start(cfg, wait_s=15.0)
        yield cfg


def _models_of(cfg: Config, uid: int, seeds: list[int]) -> list[str]:
    home = cfg.root / f"home{uid}"
    home.mkdir(mode=0o700)
    os.chown(home, uid, -1)
    paths = []
    for seed in seeds:
        p = write_st(home / f"m{seed}.safetensors", tensors(seed))
        os.chown(p, uid, -1)
        paths.append(str(p))
    return paths


def _import_all(cfg: Config, paths: list[str]) -> list[str]:
    return [outcome(access.import_model, cfg, p) for p in paths]


def _hold_and_import(cfg: Config, held: list[str], path: str) -> str:
    with access.use_entry(cfg, held[0]), access.use_entry(cfg, held[1]):
        return outcome(access.import_model, cfg, path)


def _use_many(cfg: Config, ref: str, count: int) -> dict[str, Any]:
    client = Client(cfg)
    t0 = time.monotonic()
    for i in range(count):
        got = outcome(client.call, "pool.use", ref=ref)
        if got != "ok":
            return {"refused_at": i, "why": got, "s": time.monotonic() - t0}
    return {"refused_at": None, "why": "", "s": time.monotonic() - t0}


def _names(cfg: Config) -> set[str]:
    return {e.manifest.name for e in Pool.from_config(cfg).entries()}


def test_a_users_imports_stay_in_their_share(cfg: Config, user_uid: int,
                                            other_uid: int) -> None:  # fmt: skip
    access.import_model(cfg, write_st(cfg.root / "r1.safetensors", tensors(1)), "r1")
    (o2,) = _models_of(cfg, other_uid, [2])
    assert spawn_as(other_uid, _import_all, cfg, [o2]).result() == ["ok"]
    mine = _models_of(cfg, user_uid, [3, 4, 5, 6])
    assert spawn_as(user_uid, _import_all, cfg, mine[:3]).result() == ["ok"] * 3
    # m5 went over the user's share: the user's own oldest went, not root's nor the other's
    assert _names(cfg) == {"r1", "m2", "m4", "m5"}
    got = spawn_as(user_uid, _hold_and_import, cfg, ["m4", "m5"], mine[3]).result()
    assert got.startswith(f"PoolFull: your share of the pool is full: uid {user_uid}'s "
                          "imports hold"), got  # fmt: skip
    assert "your entries in use: " in got and "m4 (" in got and "m5 (" in got, got
    assert _names(cfg) == {"r1", "m2", "m4", "m5"}
    # what went and what was refused is in the event log, for the user and for root
    log = events.tail(cfg.paths.events, 200)
    evicted = [e for e in log if e["kind"] == "pool.evicted"]
    assert [(e["uid"], e["detail"]["name"], e["detail"]["why"], e["detail"]["importers"])
            for e in evicted] == [(user_uid, "m3", "the importing user's share "
                                   "(SPSWAP_POOL_USER_BYTES)", [user_uid])]  # fmt: skip
    assert evicted[0]["detail"]["to_make_room_for"] == "m5"
    (refused,) = [e for e in log if e["kind"] == "pool.refused"]
    assert refused["uid"] == user_uid and refused["detail"]["name"] == "m6"
    assert refused["detail"]["reason"].startswith("your share of the pool is full")


def test_a_user_cannot_grow_the_use_records_without_bound(cfg: Config, user_uid: int) -> None:
    access.import_model(cfg, write_st(cfg.root / "r1.safetensors", tensors(1)), "r1")
    got = spawn_as(user_uid, _use_many, cfg, "r1", MAX_USES_PER_USER + 1).result()
    assert got["refused_at"] == MAX_USES_PER_USER, got
    assert got["why"].startswith(f"RequestRefused: you (uid {user_uid}) hold "
                                 f"{MAX_USES_PER_USER} uses of pool entries"), got  # fmt: skip
    # root's own uses are not bounded by it, and the daemon still answers the user
    Pool.from_config(cfg).acquire_use("r1")
    assert spawn_as(user_uid, outcome, Client(cfg).call, "ping").result() == "ok"


def _hold_uses(cfg: Config, refs: list[str], go: str) -> str:
    """Hold a use of each entry (another user's) until ``go`` exists."""
    from contextlib import ExitStack

    with ExitStack() as stack:
        for ref in refs:
            stack.enter_context(access.use_entry(cfg, ref))
        open(go + ".held", "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.05)
    return "done"


def test_another_users_uses_cannot_lock_a_share(cfg: Config, user_uid: int,
                                               other_uid: int) -> None:  # fmt: skip
    """A user who takes uses of another user's entries (pool.use: entries are readable by
    all) does not fill that user's share: the entries stay (in use) on the user who
    uses them. Before, every later import of the owner was refused ('your share ... is
    full') for as long as the other user's process lived."""
    mine = _models_of(cfg, user_uid, [3, 4, 5])
    assert spawn_as(user_uid, _import_all, cfg, mine[:2]).result() == ["ok"] * 2
    sync = cfg.root / "sync"
    sync.mkdir(mode=0o777)
    os.chmod(sync, 0o777)
    go = str(sync / "go")
    holder = spawn_as(other_uid, _hold_uses, cfg, ["m3", "m4"], go)
    deadline = time.monotonic() + 30
    while not os.path.exists(go + ".held") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(go + ".held"), "the other user's uses were never taken"
    assert spawn_as(user_uid, _import_all, cfg, mine[2:]).result() == ["ok"]
    importers = {e.manifest.name: e.importers for e in Pool.from_config(cfg).entries()}
    assert importers["m5"] == [user_uid] and other_uid in importers["m3"], importers
    assert user_uid not in importers["m3"], importers
    open(go, "w").close()
    assert holder.result() == "done"
