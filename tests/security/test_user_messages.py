"""What a second real uid is told: in commands and flags, and true (issue 15, item 16)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import spswap.serve.front  # noqa: F401  (the user child cannot import it from root's venv)
import spswap.status  # noqa: F401
from spswap.cli.app import app
from spswap.config import Config
from spswap.pool.store import Pool
from tests.pool.st_files import tensors, write_st
from tests.security.conftest import as_user


def _cli(cfg: Config, *args: str) -> dict[str, Any]:
    r = CliRunner().invoke(app, [*args, "--root", str(cfg.root)])
    return {
        "code": r.exit_code,
        "out": r.stdout,
        "err": r.stderr if r.stderr_bytes else "",
        "error": "" if r.exception is None else str(r.exception),
    }


def _warm_up(cfg: Config) -> None:
    """Import, while still root, what the commands load lazily."""
    for args in (
        ["pool", "rm", "--help"],
        ["slots", "reserve", "--help"],
        ["status"],
        ["status", "--json"],
        ["pool", "rm", "nothing-here"],
    ):
        _cli(cfg, *args)
    import spswap.access  # noqa: F401
    import spswap.daemon.client  # noqa: F401


def _one(text: str) -> str:
    return " ".join(text.split())


def test_asking_another_users_socket_says_whose_it_is(user_uid: int) -> None:
    from spswap.serve.front import ask

    d = Path(tempfile.mkdtemp(prefix="spm-", dir="/tmp"))  # root's, 0700: not the user's
    path = d / "serve-5.sock"
    listener = socket.socket(socket.AF_UNIX)
    old = os.umask(0o177)
    try:
        listener.bind(str(path))
    finally:
        os.umask(old)
    listener.listen(1)

    def asks() -> str:
        try:
            ask(path, {"prompt_ids": [1]}, timeout_s=5)
        except Exception as e:
            return str(e)
        return "answered"

    try:
        said = as_user(user_uid, asks)
    finally:
        listener.close()
    assert said == (f"{path} belongs to another user (root, uid 0): a serving job's socket "
                    "answers its own user only (and root); ask a job of yours")  # fmt: skip
    # the socket of a run that ended: nothing listens on the file it left
    assert asks() == (
        f"nothing listens on {path} any more: the run that opened it has ended "
        "(or is stopped for a preemption); ask again once the job runs"
    )


@pytest.mark.parametrize("mode", [0o755, 0o700])
@pytest.mark.parametrize("entry", ["--state-dir", "--job"])
def test_asking_another_users_job_through_its_spool_says_whose_it_is(
    user_uid: int, mode: int, entry: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`spswap ask --job N` of another user's job said "cannot use .../inbox: permission
    denied; run as root, or give a --root (SPSWAP_ROOT) this user may read": the job's
    folder is no root (newcomer walk, bob asking alice's job). Through --job the folder
    is found from Slurm's record (here a stand-in: no controller) and looked into first."""
    import spswap.serve.spool_ask  # noqa: F401  (imported as root)
    from spswap.errors import PermissionDenied
    from spswap.serve.spool import Spool
    from spswap.serve.spool_ask import ask_spool, job_state_dir
    from spswap.slurm.backend import CliBackend
    from spswap.slurm.parse import JobInfo

    work = Path(tempfile.mkdtemp(prefix="spj-", dir="/tmp"))  # root's job working directory
    work.chmod(0o755)
    state = work / ".spswap" / "77"
    spool = Spool(state)
    for d in (state.parent, state, spool.inbox, spool.outbox):
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o755)
    state.chmod(mode)  # 0700: not even looked into (as a home under umask 077)
    monkeypatch.setattr(CliBackend, "job", lambda self, job_id: JobInfo(
        job_id=job_id, state="RUNNING", work_dir=str(work)))  # fmt: skip

    def asks() -> str:
        try:
            where = state if entry == "--state-dir" else job_state_dir("77")[0]
            ask_spool(where, {"prompt_ids": [1]}, timeout_s=1)
        except PermissionDenied as e:
            return f"PermissionDenied: {e}"
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "answered"

    try:
        assert as_user(user_uid, asks) == (
            f"PermissionDenied: {state} belongs to another user (root, uid 0): a serving "
            "job's state directory takes requests from its own user only (and root); ask a "
            "job of yours"
        )
        assert list(spool.inbox.iterdir()) == []  # nothing of the user's was put there
    finally:
        shutil.rmtree(work)


def test_pool_rm_as_a_user_says_it_is_roots(cfg: Config, daemon: int, user_uid: int,
                                            tmp_path: Path) -> None:  # fmt: skip
    write_st(tmp_path / "m.safetensors", tensors(0))
    m = Pool.from_config(cfg).import_checkpoint(tmp_path / "m.safetensors", name="mine")
    _warm_up(cfg)
    res = as_user(user_uid, _cli, cfg, "pool", "rm", "mine")
    assert res["code"] != 0, res
    assert res["error"] == (
        f"only root removes pool entries (the pool is every job's on this node; you are uid "
        f"{user_uid}): ask the node's admin to run `spswap pool rm mine`. mine needs no "
        "removal to make room: entries no job uses are evicted, least recently used first, "
        "when an import needs their space")  # fmt: skip
    assert "spswap.access" not in res["error"]
    assert Pool.from_config(cfg).find("mine").digest == m.digest

    def direct() -> str:
        try:
            Pool.from_config(cfg).remove("mine")
        except Exception as e:
            return str(e)
        return "removed"

    said = as_user(user_uid, direct)
    assert said == (f"cannot change the pool: the pool ({cfg.paths.pool}) is root's (you are "
                    f"uid {user_uid}); as a user, `spswap pool import` and `spswap serve` "
                    "write it through spswapd (started by the Slurm prolog, or by root with "
                    "`spswap daemon start`); removing an entry is root's alone")  # fmt: skip


def test_slots_reserve_outside_a_job_is_refused(cfg: Config, daemon: int, user_uid: int,
                                                monkeypatch) -> None:  # fmt: skip
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _warm_up(cfg)
    res = as_user(user_uid, _cli, cfg, "slots", "reserve", "--model", "m")
    assert res["code"] != 0 and res["out"] == "", res
    assert res["error"] == (
        "outside a Slurm job a reservation of yours would end with this command (it is held "
        "for the process that asked, which exits at once): run it in your job (e.g. `srun "
        "--jobid=JOB --overlap spswap slots reserve ...`) or give --job-id JOB of a running "
        "job of yours")  # fmt: skip
    from spswap.slots.table import SlotTable

    assert SlotTable(cfg.paths.slots, [0, 1]).reservations() == []


def test_status_as_a_user_shows_no_pid_of_minus_one(cfg: Config, daemon: int,
                                                    user_uid: int) -> None:  # fmt: skip
    import json

    _warm_up(cfg)
    table = as_user(user_uid, _cli, cfg, "status")
    assert table["code"] == 0, table
    assert "pid -1" not in table["out"]
    line = next(ln for ln in table["out"].splitlines() if ln.startswith("daemon"))
    assert line.split() == ["daemon", "running"]
    data = json.loads(as_user(user_uid, _cli, cfg, "status", "--json")["out"])
    assert data["daemon"] == {"running": True, "pid": None}
    root_view = json.loads(_cli(cfg, "status", "--json")["out"])
    assert root_view["daemon"] == {"running": True, "pid": daemon}
