"""scripts/slurm_up.sh down ends only its own cluster's step daemons (issue 15 item 15:
it killed every slurmstepd on the host). No Slurm needed: stand-in step daemons, one
holding a file of the cluster's state directory as a real one holds slurmd's log."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from spswap.liveness import pid_alive

SLURM_UP = Path(__file__).resolve().parents[2] / "scripts" / "slurm_up.sh"


def test_down_kills_only_its_own_slurmstepd(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("slurm_up.sh runs as root")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stepd = bin_dir / "slurmstepd"  # /proc/PID/exe ends in /slurmstepd, as a real one's
    shutil.copy("/bin/sleep", stepd)
    ours_dir, theirs_dir = tmp_path / "ours", tmp_path / "theirs"
    for d in (ours_dir / "log", theirs_dir / "log"):
        d.mkdir(parents=True)
    procs = {}
    for name, d in (("ours", ours_dir), ("theirs", theirs_dir)):
        log = open(d / "log" / "slurmd.log", "a")  # noqa: SIM115 (held by the child)
        procs[name] = subprocess.Popen([str(stepd), "300"], stdout=log, stderr=log)
        log.close()
    try:
        time.sleep(0.2)
        env = {"PATH": os.environ["PATH"], "SLURM_CI_DIR": str(ours_dir),
               "SLURM_UP_DEFAULTS_FILE": str(tmp_path / "default-spswap")}  # fmt: skip
        down = subprocess.run([str(SLURM_UP), "down"], env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert down.returncode == 0, down.stderr
        assert procs["ours"].wait(timeout=10) == -9
        assert pid_alive(procs["theirs"].pid) and procs["theirs"].poll() is None
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


@pytest.mark.parametrize("whose", ["the site's", "its own, edited"])
def test_a_refused_up_writes_and_starts_nothing(tmp_path: Path, whose: str) -> None:
    """A walk: refused for a settings file it did not write, `up` had started munged and
    made its state directory first (docs/slurm.md: "a refused run changes nothing")."""
    if os.geteuid() != 0:
        pytest.skip("slurm_up.sh runs as root")
    if any(shutil.which(c) is None for c in ("slurmctld", "slurmd", "sbatch", "munged")):
        pytest.skip("Slurm is not installed here (a refused run would install it first)")
    site = tmp_path / "default-spswap"
    state = tmp_path / "slurm-ci"
    text = "SPSWAP_BIN=/usr/local/bin/spswap\n"
    said = f"{site} exists and was not written by this script"
    if whose != "the site's":  # a walk's edit was written over without a word
        written = "# written by spswap scripts/slurm_up.sh\nSPSWAP_BIN=/bin/true\n"
        state.mkdir()
        (state / "spswap-defaults.written").write_text(written)
        text = written + "SPSWAP_KEEP_BYTES=1G\n"
        said = (
            f"{site} was edited after this script wrote it (SPSWAP_KEEP_BYTES=1G): run "
            "this again without SPSWAP_BIN and SPSWAP_ROOT to keep it as it is"
        )
    site.write_text(text)
    before = sorted(p.name for p in state.iterdir()) if state.exists() else None
    env = {"PATH": os.environ["PATH"], "SLURM_CI_DIR": str(state),
           "SLURM_UP_DEFAULTS_FILE": str(site), "SPSWAP_BIN": "/bin/true"}  # fmt: skip
    up = subprocess.run([str(SLURM_UP), "up"], env=env, capture_output=True, text=True,
                        timeout=120)  # fmt: skip
    assert up.returncode == 1, up.stderr
    assert said in up.stderr, up.stderr
    # no state, spool or log directory, no munged.ours
    assert (sorted(p.name for p in state.iterdir()) if state.exists() else None) == before
    assert site.read_text() == text
