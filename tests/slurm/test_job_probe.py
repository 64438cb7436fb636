"""The job probe that the pool and the slot table plug in."""

from __future__ import annotations

import os
import stat

from spswap.slurm.backend import job_probe


def test_no_slurm_commands_means_no_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert job_probe() is None


def test_probe_makes_its_backend_on_first_use(tmp_path, monkeypatch):
    """Slurm commands that answer nothing useful: the probe exists, costs nothing until
    it is asked, and then says it cannot tell (None), never "dead"."""
    calls = tmp_path / "calls"
    for name in ("squeue", "scontrol", "sbatch", "scancel", "sinfo"):
        p = tmp_path / name
        p.write_text(f"#!/bin/sh\necho {name} >> {calls}\nexit 1\n")
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    probe = job_probe(timeout_s=5)
    assert probe is not None
    assert not calls.exists()
    assert probe("123") is None
    assert calls.exists()
