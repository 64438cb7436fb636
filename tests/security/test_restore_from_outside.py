"""A user's restore asked from outside the job's cgroup is refused before anything is
restored (a real spswapd, a second uid, a real cgroup named as Slurm names a job's): the
restored instance joins the asker's cgroups, and from a login shell it would run outside
the job's limits. From inside the job's cgroup the restore goes on as before.

Before the check, the outside asker's restore went on (here: to "no checkpoint image").
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from spswap.checkpoint import cgroup_paths
from spswap.config import Config
from spswap.daemon.client import Client
from tests.security.conftest import JOB, _remove_cgroups
from tests.uids import TEST_USER, spawn_as

IDENT = {"engine": "reference", "engine_version": "0", "torch": "0", "python": "3",
         "model_digest": "ab" * 32, "config_hash": "cd" * 32}  # fmt: skip


@pytest.fixture(autouse=True)
def _no_slurm_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    # (autouse: before the daemon starts, which inherits it) no scontrol/squeue: with no
    # controller each query would take 10-18 s
    monkeypatch.setenv("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/sbin")


def _restore_when(cfg: Config, go: str) -> str:
    """Wait for ``go`` to exist (the test moves this process first, or not), then ask."""
    deadline = time.monotonic() + 30
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        Client(cfg).call("restore", job_id=JOB, restart_count=1, **IDENT)
        return "restored"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def _ask(cfg: Config, uid: int, tmp: Path, into: Path | None) -> str:
    go = tmp / f"go-{uuid.uuid4().hex[:6]}"  # in a folder the user can read
    child = spawn_as(uid, _restore_when, cfg, str(go))
    if into is not None:
        (into / "cgroup.procs").write_text(str(child.pid))
    go.touch()
    result: str = child.result()
    return result


def test_a_restore_asked_from_outside_the_jobs_cgroup_is_refused(
    cfg: Config, daemon: int, user_uid: int, job_cgroup: Path
) -> None:
    Client(cfg).call("job.register", job_id=JOB, uid=user_uid, user=TEST_USER)
    tmp_path = cfg.root  # (0755, where the user's process sees the go file)
    outside = _ask(cfg, user_uid, tmp_path, None)
    assert outside.startswith("PermissionDenied: pid "), outside
    assert f"asked to restore job {JOB}'s instance from outside the job's cgroup " in outside
    assert f"({job_cgroup})" in outside and f"srun --jobid={JOB} --overlap" in outside
    inside = _ask(cfg, user_uid, tmp_path, job_cgroup)
    assert not inside.startswith("PermissionDenied"), inside
    assert "no checkpoint image" in inside, inside


def test_a_folder_named_like_the_job_in_a_users_own_cgroup_is_not_the_job(
    cfg: Config, daemon: int, user_uid: int, job_cgroup: Path
) -> None:
    """A user with a delegated cgroup (systemd's user@.service) can make a folder named
    job_<id> under it and run there: that is not the job's cgroup (Slurm's are root's),
    and the restore is refused as from outside. Before, the name alone let it pass."""
    Client(cfg).call("job.register", job_id=JOB, uid=user_uid, user=TEST_USER)
    delegated = job_cgroup.parent.parent / f"spswap-test-deleg-{uuid.uuid4().hex[:8]}"
    fake = delegated / f"job_{JOB}"
    fake.mkdir(parents=True)
    try:
        for d in (delegated, fake):
            os.chown(d, user_uid, -1)
        got = _ask(cfg, user_uid, cfg.root, fake)
        assert got.startswith("PermissionDenied: pid "), got
        assert "from outside the job's cgroup" in got, got
    finally:
        _remove_cgroups(fake, delegated)


def test_the_asker_is_the_process_that_asked_not_its_pid() -> None:
    from spswap.daemon.ckpt_restore import Asker

    me = Asker.of(os.getpid())
    assert me.alive() and me.cgroups == cgroup_paths.memberships(os.getpid())
    assert me.start is not None
    assert not Asker(os.getpid(), me.start + 1, me.cgroups).alive()  # the pid, another start
    assert not Asker(os.getpid(), None, []).alive()
