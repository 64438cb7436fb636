"""The node's image budget with a real spswapd, real CRIU and a second uid's processes:
one user's dumps cannot fill the images' file system. A user's dump over the user's share
drops that user's oldest image (never root's or another user's); a dump that cannot fit
even then is refused with the reason, and the process runs on.

Before the budget every dump was written: the user's images together took whatever the
tmpfs had (the first assertion on the dropped image fails there).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spswap.config import Config
from spswap.daemon import lifecycle
from spswap.daemon.client import Client
from spswap.fsutil import read_json
from tests.checkpoint.criu_helpers import criu_skip_reason
from tests.security.user_instance import ASK_CHECKPOINT
from tests.uids import node_root

pytestmark = [pytest.mark.criu, pytest.mark.slow]
MIB = 1 << 20
# no scontrol/squeue (/usr/bin): with no controller each query would take 10-18 s
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/sbin"
IDENT = {"engine": "reference", "engine_version": "0", "torch": "0", "python": "3",
         "model_digest": "ab" * 32, "config_hash": "cd" * 32}  # fmt: skip

# Holds BALLAST_MIB of its own memory, asks spswapd to checkpoint it (as `spswap serve`
# does at a stop), then waits to be dumped; a refused dump resumes it (SIGUSR2).
INSTANCE = (
    ASK_CHECKPOINT
    + """
import os, signal, sys, time
sock, job, ident, out, mib = sys.argv[1:6]
ballast = bytearray(os.urandom(1 << 20) * int(mib))
signal.signal(signal.SIGUSR2, lambda *_: open(out + ".resumed", "w").close())
reply = ask_checkpoint(sock, job, json.loads(ident))
open(out + ".reply", "wb").write(reply)
deadline = time.time() + 120
while time.time() < deadline:
    time.sleep(0.05)
"""
)


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch, user_uid: int) -> Iterator[Config]:
    """A root whose spswapd keeps no dumped tree alive and lets one user's images hold
    128 MiB, all images 300 MiB (each instance holds about 70 MiB: its image)."""
    reason = criu_skip_reason()
    if reason:
        pytest.skip(reason)
    env = {"SPSWAP_GPUS": "0", "SPSWAP_KEEP_BYTES": "0",
           "SPSWAP_IMAGES_USER_BYTES": "128M", "SPSWAP_IMAGES_BYTES": "300M"}  # fmt: skip
    for k, v in {**env, "PATH": PATH}.items():
        monkeypatch.setenv(k, v)  # the daemon inherits them
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with node_root("spsimg-", env) as cfg:
        lifecycle.start(cfg, wait_s=15.0)
        yield cfg


@pytest.fixture
def work(user_uid: int) -> Iterator[Path]:
    top = Path(tempfile.mkdtemp(prefix="spsimg-work-", dir="/tmp"))
    os.chmod(top, 0o755)
    os.chown(top, user_uid, -1)
    yield top
    shutil.rmtree(top, ignore_errors=True)


def _instance(cfg: Config, work: Path, uid: int, job: str, mib: int) -> int:
    """An instance of job ``job`` run as ``uid`` (a session leader with no inherited
    files) that asks for its own checkpoint; its pid."""
    gid = pwd.getpwuid(uid).pw_gid
    (work / "instance.py").write_text(INSTANCE)
    pidfile = work / f"{job}.pid"
    subprocess.run(
        ["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "sh", "-c",
         'setsid /usr/bin/python3 "$0" "$@" </dev/null >/dev/null 2>&1 & echo $! > "$PIDFILE"',
         str(work / "instance.py"), str(cfg.paths.socket), job, json.dumps(IDENT),
         str(work / job), str(mib)],
        check=True, timeout=10,
        env={**os.environ, "PATH": "/usr/bin:/bin", "PIDFILE": str(pidfile)},
    )  # fmt: skip
    return int(pidfile.read_text())


def _settled(cfg: Config, job: str) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = read_json(cfg.paths.run / "checkpoints" / f"{job}.json") or {}
        if status.get("state") not in (None, "dumping"):
            return status
        time.sleep(0.1)
    raise AssertionError(f"job {job}'s dump did not end")


def _dump(cfg: Config, work: Path, uid: int, job: str, mib: int = 64) -> dict:
    """Job ``job`` of ``uid`` registered, its instance dumped (or refused); then the
    job's run ends, requeued (its image waits for its next run)."""
    root = Client(cfg)
    root.call("job.register", job_id=job, uid=uid, user=pwd.getpwuid(uid).pw_name)
    pid = _instance(cfg, work, uid, job, mib)
    status = _settled(cfg, job)
    if status["state"] == "saved":
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    root.call("job.end", job_id=job, requeued=True)
    return {**status, "pid": pid}


def _image_jobs(cfg: Config) -> list[str]:
    return sorted(p.name[3:].split("-", 1)[0] for p in cfg.paths.images.iterdir()
                  if p.is_dir() and p.name.startswith("job"))  # fmt: skip


def _events(cfg: Config, kind: str) -> list[dict]:
    lines = cfg.paths.events.read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def test_a_users_dumps_over_the_users_share_drop_only_that_users_oldest_image(
    node: Config, work: Path, user_uid: int
) -> None:
    cfg = node
    assert _dump(cfg, work, 0, "100")["state"] == "saved"  # root's job: never dropped
    assert _dump(cfg, work, user_uid, "201")["state"] == "saved"
    assert _image_jobs(cfg) == ["100", "201"]
    # two images of the user: ~70 MiB + the estimate (~70 MiB + 16 MiB) > 128 MiB
    assert _dump(cfg, work, user_uid, "202")["state"] == "saved"
    assert _image_jobs(cfg) == ["100", "202"], "the user's oldest image made room"
    dropped = _events(cfg, "images.dropped")
    assert [(e["job_id"], e["detail"]["for_job"]) for e in dropped] == [("201", "202")]
    old = read_json(cfg.paths.run / "checkpoints" / "201.json") or {}
    assert old["state"] == "deleted"
    assert "to make room for the image of job 202, of the same user (its image (about " \
        in old["reason"] and "would be more than SPSWAP_IMAGES_USER_BYTES (128.0 MiB))" \
        in old["reason"]  # (the limit it was over, not both)  # fmt: skip
    # its next run is told why it starts cold
    assert "make room" in Client(cfg).call("checkpoint.status", job_id="201")["reason"]


def test_a_dump_that_cannot_fit_is_refused_and_the_instance_runs_on(
    node: Config, work: Path, user_uid: int
) -> None:
    cfg = node
    assert _dump(cfg, work, user_uid, "201")["state"] == "saved"
    big = _dump(cfg, work, user_uid, "203", mib=200)
    assert big["state"] == "failed", big
    assert big["reason"].startswith("no room for job 203's image: its image (about "), big
    assert "would be more than SPSWAP_IMAGES_USER_BYTES (128.0 MiB)" in big["reason"], big
    assert (work / "203.resumed").exists() and Path(f"/proc/{big['pid']}").exists()
    os.kill(big["pid"], 9)
    assert _image_jobs(cfg) == ["201"], "nothing is dropped for a dump that cannot fit"
    assert _events(cfg, "images.dropped") == []
