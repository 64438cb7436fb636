"""A stop's drain fits what Slurm leaves between SIGTERM and SIGKILL (KillWait)."""

from __future__ import annotations

from spswap.serve.stop_budget import fitted_drain_s
from spswap.slurm.parse import parse_kill_wait_s

# `scontrol show config` of Slurm 22.05, the lines around it
CONFIG = """Configuration data as of 2026-12-03T07:40:00
JobRequeue              = 1
KeepAliveTime           = SYSTEM_DEFAULT
KillOnBadExit           = 0
KillWait                = 5 sec
LaunchParameters        = (null)
"""


def test_kill_wait_from_scontrol_show_config() -> None:
    assert parse_kill_wait_s(CONFIG) == 5.0
    assert parse_kill_wait_s(CONFIG.replace("= 5 sec", "= 30 sec")) == 30.0
    assert parse_kill_wait_s("KillOnBadExit = 0\n") is None
    assert parse_kill_wait_s("KillWait = soon\n") is None


def test_a_drain_that_fits_is_kept() -> None:
    assert fitted_drain_s(5.0, 30.0) == (5.0, None)
    assert fitted_drain_s(5.0, None) == (5.0, None)  # Slurm not asked: as given
    assert fitted_drain_s(1.0, 3.0) == (1.0, None)


def test_a_drain_as_long_as_kill_wait_is_cut_and_says_why() -> None:
    # the walk's case: KillWait 5, drain 5: the job was killed before its model was saved
    drain, why = fitted_drain_s(5.0, 5.0)
    assert drain == 3.0
    assert why == ("spswap serve: the drain at a stop (--drain-s, 5 s) cut to 3 s: Slurm kills "
                   "a stopped job 5 s after its SIGTERM (KillWait), and what it serves must be put "
                   "away before that (2 s kept for it)")  # fmt: skip
    assert fitted_drain_s(5.0, 1.0)[0] == 0.5  # never below half a second
    assert fitted_drain_s(0.2, 1.0) == (0.2, None)  # already shorter than the floor
