"""A real single-node Slurm for the integration tests (scripts/slurm_up.sh).

Started once per session when SPSWAP_TEST_SLURM=1 (root, Debian/Ubuntu: the script
installs slurmctld, slurmd and munge with apt), stopped at the end; skipped otherwise.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .cluster import DEFAULTS_FILE, SLURM_UP, SlurmCluster, wait_for

__all__ = ["SlurmCluster", "wait_for"]  # tests import these from here too
LOG_TAIL_LINES = 40


def log_tails(cluster: SlurmCluster) -> list[tuple[str, str]]:
    """The last lines of slurmctld's, slurmd's and spswapd's logs: what a failure seen
    only in CI needs beside the test's own message."""
    from spswap.config import Config
    from spswap.daemon.lifecycle import log_path

    ci_dir = Path(os.environ.get("SLURM_CI_DIR", "/tmp/spswap-slurm")) / "log"
    paths = [ci_dir / "slurmctld.log", ci_dir / "slurmd.log",
             log_path(Config.from_env({}, root=cluster.spswap_root))]  # fmt: skip
    out = []
    for path in paths:
        try:
            lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        except OSError as e:
            lines = [f"(not read: {e})"]
        out.append((f"{path.name} (last {LOG_TAIL_LINES} lines)", "\n".join(lines)))
    return out


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """A failed test of the real Slurm shows the daemons' last log lines."""
    outcome = yield
    report = outcome.get_result()
    cluster = getattr(item, "funcargs", {}).get("slurm_cluster")
    if report.when in ("setup", "call") and report.failed and isinstance(cluster, SlurmCluster):
        for title, text in log_tails(cluster):
            report.sections.append((title, text))


def default_proctrack() -> str:
    """proctrack/cgroup (what the guide recommends, and what lets spswapd park a tree
    outside its job) where Slurm 22.05 can use it without systemd: a cgroup v1 freezer, or
    cgroup v2; else linuxproc. The same choice as scripts/slurm_up.sh's default (which
    then runs task/cgroup too). SPSWAP_TEST_PROCTRACK overrides."""
    usable = (Path("/sys/fs/cgroup/freezer/cgroup.procs").exists()
              or Path("/sys/fs/cgroup/cgroup.controllers").is_file())  # fmt: skip
    return "cgroup" if usable else "linuxproc"


def checkout_spswap(root: Path) -> str:
    """An `spswap` for the hooks (slurmd gives them no PYTHONPATH) and the jobs that runs
    this checkout's code, as the installed console script would, on this interpreter
    (the venv's, on /usr/bin/python3: users can run it). The venv's own `spswap` runs
    whatever checkout the venv was installed from."""
    from tests.daemon.conftest import ENTRY_CALL

    bin_dir = root.parent / f"{root.name}-bin"
    bin_dir.mkdir(mode=0o755)
    exe = bin_dir / "spswap"
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} -c {shlex.quote(ENTRY_CALL)} "$@"\n')
    exe.chmod(0o755)
    return str(exe)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    if os.environ.get("SPSWAP_TEST_SLURM") != "1":
        pytest.skip("real Slurm tests: run as root with SPSWAP_TEST_SLURM=1 (they start one "
                    "with scripts/slurm_up.sh)")  # fmt: skip
    if os.geteuid() != 0:
        pytest.skip("real Slurm tests need root (slurm_up.sh installs and starts slurmd)")
    if DEFAULTS_FILE.exists() and "slurm_up.sh" not in DEFAULTS_FILE.read_text():
        pytest.skip(f"{DEFAULTS_FILE} belongs to a real install: not touching it")
    work = tmp_path_factory.mktemp("slurm-jobs")
    work.chmod(0o755)
    # outside pytest's 0700 temp tree: normal users' jobs and tools reach the daemon here
    root = Path(tempfile.mkdtemp(prefix="spswap-slurm-root-", dir="/tmp"))
    root.chmod(0o755)
    spswap_bin = checkout_spswap(root)
    grace_time_s = 10
    # the hooks and the daemon they start read the settings file slurm_up.sh writes (the
    # unit tests' SPSWAP_DEFAULTS=/dev/null is not for them)
    env = {k: v for k, v in os.environ.items() if k != "SPSWAP_DEFAULTS"}
    env = dict(env, SPSWAP_BIN=spswap_bin, SPSWAP_ROOT=str(root),
               GRACE_TIME=str(grace_time_s), FAKE_GPUS="2", SPSWAP_SWEEP_INTERVAL_S="5",
               PROCTRACK=os.environ.get("SPSWAP_TEST_PROCTRACK", default_proctrack()))  # fmt: skip
    up = subprocess.run([str(SLURM_UP), "up"], env=env, capture_output=True, text=True,
                        timeout=600)  # fmt: skip
    if up.returncode != 0:
        pytest.fail(f"scripts/slurm_up.sh failed:\n{up.stdout}\n{up.stderr}")
    try:
        yield SlurmCluster(work=work, spswap_root=root, spswap_bin=spswap_bin,
                           grace_time_s=grace_time_s, proctrack=env["PROCTRACK"])  # fmt: skip
    finally:
        subprocess.run([str(SLURM_UP), "down"], env=env, capture_output=True, timeout=120)
        # the prolog started a daemon for this root: it must not outlive the tests
        from spswap.config import Config
        from spswap.daemon.lifecycle import stop

        stop(Config.from_env({}, root=root))
        # kept trees outlive a stopped daemon (its successor takes them over): with the
        # root about to go, end them, or they stay frozen on the host for good
        from spswap.checkpoint.cgroups import root_tag, sweep

        sweep(root_tag(root))
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(Path(spswap_bin).parent, ignore_errors=True)
