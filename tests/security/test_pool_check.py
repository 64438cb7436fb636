"""``pool.check`` through a real spswapd, as a second uid: a user whose restored
instance answered wrongly has the pool entry read against its checksums, and a damaged
one removed (the pool is root's: before, the user's next start read the same bad bytes
or refused to start until root ran `spswap pool rm`); a whole entry is never removed."""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path
from typing import Any

from spswap import access
from spswap.config import Config
from spswap.daemon.client import Client
from spswap.daemon.pool_checks import PoolChecks
from spswap.pool.index import file_key
from spswap.pool.store import Pool
from spswap.pool.verify import REMOVED_FIX
from tests.helpers.damage import reverse_largest_tensor
from tests.pool.st_files import tensors, write_st
from tests.security.conftest import as_user, outcome


def _check(cfg: Config, digest: str) -> str:
    return outcome(access.check_entry, cfg, digest)


def _user_check(cfg: Config, digest: str) -> object:
    return access.check_entry(cfg, digest)


def test_a_users_check_removes_a_damaged_entry_and_never_a_whole_one(
    cfg: Config, daemon: int, user_uid: int, tmp_path: Path
) -> None:
    pool = Pool.from_config(cfg)
    m = pool.import_checkpoint(write_st(tmp_path / "m.safetensors", tensors(3)), name="m")
    assert as_user(user_uid, _user_check, cfg, m.digest) is None  # whole: it stays
    assert [e.manifest.digest for e in pool.entries()] == [m.digest]
    tensor = reverse_largest_tensor(pool, m)

    problem = as_user(user_uid, access.check_entry, cfg, m.digest)
    assert problem.startswith(f"pool entry m ({m.digest[:12]}): tensor {tensor.name!r}"), problem
    assert problem.endswith(REMOVED_FIX), problem
    assert pool.entries() == []
    (ev,) = [e for e in Client(cfg).call("events.tail", n=20) if e["kind"] == "pool.damaged"]
    assert ev["uid"] == user_uid and ev["detail"]["digest"] == m.digest, ev
    # gone: the check says so (no entry to read)
    assert as_user(user_uid, _check, cfg, m.digest).startswith("PoolEntryNotFound"), m


def test_an_entry_found_whole_is_read_again_once_its_file_changes(tmp_path: Path) -> None:
    pool = Pool(tmp_path / "pool")
    m = pool.import_checkpoint(write_st(tmp_path / "m.safetensors", tensors(4)), name="m")
    checks = PoolChecks()
    key = file_key(pool.data_path(m))
    assert key is not None and not checks.known_whole(m.digest, key)
    checks.record(m.digest, key, whole=True)
    assert checks.known_whole(m.digest, key)
    reverse_largest_tensor(pool, m)
    os.utime(pool.data_path(m), ns=(0, 0))  # (a write's time may fall in the same tick)
    assert not checks.known_whole(m.digest, file_key(pool.data_path(m)))
    checks.record(m.digest, key, whole=False)
    assert not checks.known_whole(m.digest, key)


def _import_twice(cfg: Config, path: str, damage_path: str) -> dict[str, Any]:
    """As the user: import, wait for root to write over the entry, import again."""
    first = access.import_model(cfg, path, name="m").digest
    Path(damage_path).write_text("import done")
    while Path(damage_path).read_text() != "damaged":
        time.sleep(0.02)
    told: list[str] = []
    again = access.import_model(cfg, path, name="m", on_damaged=told.append).digest
    return {"first": first, "again": again, "told": told}


def test_a_users_start_from_an_entry_written_over_imports_it_again_whole(
    cfg: Config, daemon: int, user_uid: int
) -> None:
    # before entries were sealed, the user's next import found the entry by its source
    # files and its job served from the written-over bytes: no error, wrong answers
    home = cfg.root / "home"
    home.mkdir(mode=0o700)
    os.chown(home, user_uid, -1)
    path = write_st(home / "m.safetensors", tensors(3))
    os.chown(path, user_uid, -1)
    flag = home / "flag"
    flag.write_text("")
    os.chown(flag, user_uid, -1)
    pool = Pool.from_config(cfg)

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(as_user, user_uid, _import_twice, cfg, str(path), str(flag))
        deadline = time.monotonic() + 30
        while flag.read_text() != "import done" and time.monotonic() < deadline:
            time.sleep(0.02)
        m = pool.find("m")
        os.chmod(pool.data_path(m), 0o644)
        tensor = reverse_largest_tensor(pool, m)
        os.utime(pool.data_path(m), ns=(0, 1))  # (a write may fall in the seal's tick)
        flag.write_text("damaged")
        out = fut.result(timeout=60)

    assert out["again"] == out["first"] == m.digest  # the same content, whole again
    pool.verify(m.digest)
    (told,) = out["told"]
    assert told.startswith(f"pool entry m ({m.digest[:12]}): tensor {tensor.name!r}"), told
    assert told.endswith(REMOVED_FIX), told
    (ev,) = [e for e in Client(cfg).call("events.tail", n=20) if e["kind"] == "pool.damaged"]
    assert ev["uid"] == user_uid and ev["detail"]["digest"] == m.digest, ev


def _use(cfg: Config, digest: str) -> str:
    def hold() -> None:
        with access.use_entry(cfg, digest):
            pass

    return outcome(hold)


def test_a_users_use_of_an_entry_written_over_is_refused_and_the_entry_removed(
    cfg: Config, daemon: int, user_uid: int, tmp_path: Path
) -> None:
    pool = Pool.from_config(cfg)
    m = pool.import_checkpoint(write_st(tmp_path / "m.safetensors", tensors(3)), name="m")
    assert as_user(user_uid, _use, cfg, m.digest) == "ok"  # sealed: a stat, no read
    os.chmod(pool.data_path(m), 0o644)
    tensor = reverse_largest_tensor(pool, m)
    os.utime(pool.data_path(m), ns=(0, 1))

    got = as_user(user_uid, _use, cfg, m.digest)
    assert got.startswith(f"PoolCorrupt: pool entry m ({m.digest[:12]}): tensor "
                          f"{tensor.name!r}"), got  # fmt: skip
    assert pool.entries() == []
