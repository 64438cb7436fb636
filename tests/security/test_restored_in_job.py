"""A user's image is restored inside the cgroups of the run that asked for it (a real
spswapd, real CRIU as the user, a second uid, a real cgroup named as Slurm names a job's):
the restored process never runs in spswapd's cgroups, whose device rules allow every GPU
of the node and whose limits are not the job's.

Before, CRIU restored the tree into spswapd's own cgroups and spswapd moved it into the
run's afterwards: a process that looked at its cgroup as it came back saw spswapd's.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from spswap.checkpoint import cgroup_paths
from spswap.config import Config
from spswap.daemon.client import Client
from tests.checkpoint.criu_helpers import needs_criu
from tests.security.conftest import JOB
from tests.security.test_restore_from_outside import IDENT, _ask
from tests.security.user_instance import ASK_CHECKPOINT
from tests.slurm.cluster import wait_for

pytestmark = [pytest.mark.criu, needs_criu]

# The user's instance, as small as one can be: it asks spswapd to checkpoint it (as
# `spswap serve` does at a stop), then looks at its cgroup every millisecond and writes it
# down at its start and whenever it comes back from a pause (a dump and a restore): the
# first look after the restore is where CRIU put it.
WATCHER = (
    ASK_CHECKPOINT
    + """
import signal, sys, time
signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # (spswapd's "look at your status")
sock_path, job, ident, out = sys.argv[1:5]
reply = ask_checkpoint(sock_path, job, json.loads(ident))
def where():
    with open("/proc/self/cgroup") as f:
        return " ".join(f.read().split())
with open(out, "a") as f:
    f.write("asked " + reply.decode().strip() + "\\n" + "started " + where() + "\\n")
last = time.monotonic()
while True:
    now = time.monotonic()
    if now - last > 0.5:
        with open(out, "a") as f:
            f.write("resumed " + where() + "\\n")
    last = now
    time.sleep(0.001)
"""
)


@pytest.fixture
def work(user_uid: int) -> Iterator[Path]:
    """A directory the user may write, under one everybody may pass."""
    top = Path(tempfile.mkdtemp(prefix="spswap-rij-", dir="/tmp"))
    os.chmod(top, 0o755)
    (top / "w").mkdir()
    os.chown(top / "w", user_uid, -1)
    yield top / "w"
    shutil.rmtree(top, ignore_errors=True)


def _start_watcher(cfg: Config, uid: int, out: Path) -> int:
    """The watcher as ``uid``, a session leader reparented to init (its pid is free for
    the restore once the dump ends it); its pid."""
    gid = pwd.getpwuid(uid).pw_gid
    subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "sh", "-c",
         'setsid /usr/bin/python3 -c "$0" "$1" "$2" "$3" "$4" </dev/null >/dev/null 2>&1 & '
         'echo $! > "$5"', WATCHER, str(cfg.paths.socket), JOB, json.dumps(IDENT), str(out),
         str(out) + ".pid"],
        check=True, timeout=10,
    )  # fmt: skip
    return int(Path(str(out) + ".pid").read_text())


def test_a_users_image_comes_back_inside_the_runs_cgroup_never_spswapds(
    cfg: Config, daemon: int, user_uid: int, job_cgroup: Path, work: Path
) -> None:
    Client(cfg).call("job.register", job_id=JOB, uid=user_uid, user=pwd.getpwuid(user_uid)[0])
    out = work / "where"
    pid = _start_watcher(cfg, user_uid, out)
    restored = None
    try:
        wait_for("the dump", lambda: Client(cfg).call("checkpoint.status", job_id=JOB)
                 .get("state") == "saved", 60)  # fmt: skip
        lines = out.read_text().splitlines()
        assert lines[0].startswith("asked ") and '"accepted":true' in lines[0], lines
        wait_for("the dumped process's pid to be free",
                 lambda: not Path(f"/proc/{pid}").exists(), 60)  # fmt: skip
        got = _ask(cfg, user_uid, cfg.root, job_cgroup)
        assert got == "restored", got
        restored = pid
        wait_for("the restored process's first look", lambda: "resumed" in out.read_text(), 30)
        v2 = next(m for m in cgroup_paths.mounts() if m.controllers == "")
        job = "/" + str(job_cgroup.relative_to(v2.mountpoint))
        resumed = [line for line in out.read_text().splitlines() if line.startswith("resumed")]
        # (its cgroup v2 line; a hybrid host lists v1's hierarchies before it)
        assert f"0::{job}" in resumed[0].split(), (resumed, out.read_text())
        kinds = [e["kind"] for e in Client(cfg).call("events.tail", n=50)]
        assert "restore.done" in kinds and "restore.criu_outside_job" not in kinds, kinds
    finally:
        for p in (pid, restored):
            if p is not None:
                try:
                    os.kill(p, 9)
                except ProcessLookupError:
                    pass
        wait_for("the watcher's end", lambda: not Path(f"/proc/{pid}").exists(), 10)
