"""``spswap serve`` in a Slurm job tells a real spswapd that a run starts, before its
imports (spswap.cli.main.tell_run_starts -> the ``job.starting`` op): the daemon hears it,
and nothing the hint meets (no job, no daemon, help) stops or slows the command."""

from __future__ import annotations

import os
import time

from spswap.cli.main import tell_run_starts
from spswap.config import Config
from spswap.daemon.client import Client


def _starting_events(cfg: Config) -> list[dict]:
    return [e for e in Client(cfg).call("events.tail", n=200) if e["kind"] == "job.starting"]


def test_a_serve_in_a_job_tells_the_daemon_its_run_starts(cfg: Config, daemon: int) -> None:
    Client(cfg).call("job.register", job_id="41", uid=os.getuid(), user="u", restart_count=2)
    env = {"SPSWAP_ROOT": str(cfg.root), "SLURM_JOB_ID": "41"}
    t0 = time.monotonic()
    assert tell_run_starts(["serve", "/models/m", "--engine", "vllm"], env)
    sent_s = time.monotonic() - t0
    deadline = time.monotonic() + 10
    while not (got := _starting_events(cfg)):
        assert time.monotonic() < deadline, "spswapd never heard the run start"
        time.sleep(0.02)
    assert got[0]["job_id"] == "41" and got[0]["detail"]["restart_count"] == 2
    assert got[0]["detail"] == {"pid": os.getpid(), "restart_count": 2, "waking": False}
    print(f"the hint took {sent_s * 1000:.1f} ms")
    # not asked for: no job, not serve, help, another root named; nothing more heard
    for argv, e in [(["serve", "m"], {"SPSWAP_ROOT": str(cfg.root)}),
                    (["status"], env), (["serve", "--help"], env),
                    (["serve", "m", "--root", "/elsewhere"], env)]:  # fmt: skip
        assert not tell_run_starts(argv, e), argv
    # a job the daemon does not know: refused there, silently here
    assert tell_run_starts(["serve", "m"], {**env, "SLURM_JOB_ID": "999"})
    time.sleep(0.3)
    assert len(_starting_events(cfg)) == 1


def test_no_daemon_the_hint_is_silent(cfg: Config) -> None:
    env = {"SPSWAP_ROOT": str(cfg.root), "SLURM_JOB_ID": "41"}
    assert not tell_run_starts(["serve", "m"], env)
