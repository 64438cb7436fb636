"""Faults on the checkpoint path of `spswap serve`, with the real CRIU, a real spswapd and
real serving processes (the job registered with the daemon as its prolog would).

For each fault: no broken image is ever restored, the next run starts cold and says why,
every request is answered as the cold model answers it, and no slot reservation, pool
use or image is left behind. Cases: spswapd killed -9 during a dump; the engine killed -9
during a dump, during CRIU's restore, and right after it; the images' tmpfs too small for
a dump; and the image lifecycle (a pool use per image, dropped with it; the epilog keeps
a requeued job's image and deletes an ended one's).

The daemon and the serving processes run without Slurm's commands on PATH: the
controller on a test machine may be down, and each query to it then takes 10-18 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spswap.config import Config
from spswap.daemon import lifecycle
from spswap.daemon.client import Client
from spswap.fsutil import read_json
from spswap.pool.store import Pool
from spswap.slots.table import SlotTable

from .criu_helpers import criu_skip_reason

# test_serve_criu skips without torch, which cold_answers (tests/helpers) needs
from .test_serve_criu import JOB, MAX_NEW, N_REQ, _answers, _setup, _wait, cold_answers

pytestmark = [pytest.mark.criu, pytest.mark.slow]
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/sbin"  # no scontrol/squeue (/usr/bin)


def _env(cfg: Config, restart: int | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SPSWAP_"))}
    env.update(SPSWAP_ROOT=str(cfg.root), SPSWAP_GPUS="0", PATH=PATH)
    if cfg.keep_bytes is not None:
        env.update(SPSWAP_KEEP_BYTES=str(cfg.keep_bytes))
    if restart is not None:
        env.update(SLURM_JOB_ID=JOB, SLURM_RESTART_COUNT=str(restart), SLURM_JOB_GPUS="0")
    return env


def _start_daemon(cfg: Config) -> int:
    """`spswap daemon ensure`, as the prolog runs it."""
    res = subprocess.run([sys.executable, "-m", "spswap.cli", "daemon", "ensure"],
                         env=_env(cfg), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    pid = lifecycle.daemon_running(cfg)
    assert pid and pid > 0
    return pid


def _make_node(tmpfs: bool, keep_bytes: int | None = None) -> Iterator[Config]:
    reason = criu_skip_reason()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="spsf-", dir="/tmp"))
    os.chmod(root, 0o755)
    cfg = Config.from_env({"SPSWAP_GPUS": "0"}, root=root, keep_bytes=keep_bytes)
    mounted = False
    if tmpfs:
        cfg.paths.images.mkdir(mode=0o700)
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M,mode=0700", "tmpfs",
                              str(cfg.paths.images)], capture_output=True, text=True)  # fmt: skip
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
        mounted = True
    try:
        _start_daemon(cfg)
        yield cfg
    finally:
        lifecycle.stop(cfg, timeout_s=5.0)
        if mounted:
            subprocess.run(["umount", "-l", str(cfg.paths.images)], check=False)
        subprocess.run(["rm", "-rf", str(root)], check=False)


@pytest.fixture
def node() -> Iterator[Config]:
    yield from _make_node(tmpfs=False)


@pytest.fixture
def tiny_node() -> Iterator[Config]:
    yield from _make_node(tmpfs=True)


@pytest.fixture
def nokeep_node() -> Iterator[Config]:
    """A node whose spswapd keeps no dumped instance alive (SPSWAP_KEEP_BYTES=0)."""
    yield from _make_node(tmpfs=False, keep_bytes=0)


@pytest.fixture
def byte_keep_node() -> Iterator[Config]:
    """A node whose spswapd may keep 1 byte: every kept instance is over the budget."""
    yield from _make_node(tmpfs=False, keep_bytes=1)


class Runs:
    """The job's runs (restart 0, 1, ...) as `spswap serve` subprocesses."""

    def __init__(self, cfg: Config, tmp: Path) -> None:
        self.cfg, self.tmp = cfg, tmp
        self.model, self.prompts = _setup(cfg, tmp)
        self.procs: list[subprocess.Popen] = []
        self.cgroup: Path | None = None  # runs start in it (a stand-in job cgroup)

    def start(self, restart: int) -> subprocess.Popen:
        out = open(self.tmp / f"run{restart}.log", "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "spswap.cli", "serve", str(self.model), "--state-dir",
             str(self.tmp / "state"), "--device", "cpu", "--requests",
             str(self.tmp / "req.jsonl"), "--exit-when-idle", "--json"],
            env=_env(self.cfg, restart), stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, preexec_fn=self._join_cgroup if self.cgroup else None,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def _join_cgroup(self) -> None:
        assert self.cgroup is not None
        (self.cgroup / "cgroup.procs").write_text(str(os.getpid()))

    def log(self, restart: int) -> str:
        return (self.tmp / f"run{restart}.log").read_text()

    def summary(self, restart: int) -> dict:
        text = self.log(restart)
        return json.loads(text[text.index("\n{\n") :])

    def stop_run0(self) -> subprocess.Popen:
        """Run 0 answers a few requests, then gets USR1 (it parks and asks for a dump)."""
        first = self.start(0)
        _wait("the first answers", lambda: len(_answers(self.tmp)) >= 2 or first.poll() is not None)
        assert first.poll() is None, self.log(0)
        first.send_signal(signal.SIGUSR1)
        return first

    def saved_entry(self) -> tuple[Pool, Any]:
        """Run 0 stopped and its image saved; the pool and its one entry (whose pages the
        image maps)."""
        self.stop_run0().wait(timeout=120)
        assert _settled(self.cfg)["state"] == "saved", self.log(0)
        pool = Pool.from_config(self.cfg)
        (entry,) = pool.entries()
        return pool, entry

    def finish_cold(self, restart: int, needle: str) -> None:
        """A run that starts cold, says why (``needle``) and answers everything."""
        proc = self.start(restart)
        assert proc.wait(timeout=300) == 0, self.log(restart)
        log = self.log(restart)
        assert "starts anew" in log and needle in log, log
        assert self.summary(restart)["pending_left"] == 0
        answers = _answers(self.tmp)
        cold = cold_answers(self.model, self.prompts, MAX_NEW)
        assert [answers[f"q{i:02d}"] for i in range(N_REQ)] == cold

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def runs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Runs]:
    name = request.node.name
    cfg = request.getfixturevalue(
        "tiny_node"
        if "tiny" in name
        else "nokeep_node"
        if "no_keep" in name
        else "byte_keep_node"
        if "keep_budget" in name
        else "node"
    )
    r = Runs(cfg, tmp_path)
    yield r
    r.kill_all()


def _status(cfg: Config) -> dict:
    return read_json(cfg.paths.run / "checkpoints" / f"{JOB}.json") or {}


def _job_dirs(cfg: Config) -> list[str]:
    """Images and unfinished dumps of the job."""
    if not cfg.paths.images.is_dir():
        return []
    return sorted(p.name for p in cfg.paths.images.iterdir()
                  if p.name.removeprefix(".tmp-").startswith(f"job{JOB}-"))  # fmt: skip


def _dump_started(cfg: Config) -> bool:
    return _status(cfg).get("state") == "dumping" and any(
        p.startswith(".tmp-") for p in _job_dirs(cfg)
    )


def _daemon_uses(cfg: Config) -> list[int]:
    return [h.pid for e in Pool.from_config(cfg).entries() for h in e.users if h.job_id is None]


def _assert_clean(cfg: Config) -> None:
    assert _job_dirs(cfg) == []
    assert SlotTable.from_config(cfg).reservations() == []
    assert [e.users for e in Pool.from_config(cfg).entries()] == [[]]


def _settled(cfg: Config) -> dict:
    return _wait(
        "the dump to end",
        lambda: st if (st := _status(cfg)).get("state") not in (None, "dumping") else None,
        60,
    )


def _proc_state(pid: int) -> str:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return "gone"
    keep = [ln for ln in lines if ln.startswith(("State:", "TracerPid:"))]
    return ", ".join(" ".join(ln.split()) for ln in keep)


def test_daemon_killed_during_a_dump(runs: Runs) -> None:
    cfg = runs.cfg
    first = runs.stop_run0()
    _wait("the dump to start", lambda: _dump_started(cfg), 60)
    daemon = lifecycle.daemon_running(cfg)
    assert daemon and daemon > 0
    os.kill(daemon, signal.SIGKILL)
    killed_at = time.monotonic()

    def held(state: str) -> bool:
        return "(stopped)" in state or "(tracing stop)" in state

    # CRIU dies with the daemon (its log went to the daemon's pipe) and lets run 0 go; on
    # a loaded machine that may take more than a moment, never this long
    deadline = killed_at + 30
    while held(observed := _proc_state(first.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"run 0 {time.monotonic() - killed_at:.2f} s after spswapd was killed: {observed}")
    assert not held(observed), observed
    _start_daemon(cfg)  # start-up fails the stale dump and resumes run 0 if it lives
    first.wait(timeout=60)
    print(f"run 0 exit status {first.returncode}")
    status = _settled(cfg)
    assert status["state"] == "failed" and "spswapd died during the dump" in status["reason"]
    assert _job_dirs(cfg) == []
    runs.finish_cold(1, "spswapd died during the dump")
    _assert_clean(cfg)


def test_engine_killed_during_a_dump(runs: Runs) -> None:
    cfg = runs.cfg
    first = runs.stop_run0()
    _wait("the dump to start", lambda: _dump_started(cfg), 60)
    first.kill()
    # a cgroup v1 freezer (CI's hybrid hosts) holds a SIGKILL until the dump's hold is
    # thawed, after CRIU: as long as a dump takes on a slow run, not at once
    first.wait(timeout=120)
    status = _settled(cfg)
    assert status["state"] == "failed" and "criu dump" in status["reason"], status
    assert _job_dirs(cfg) == []  # the partial image was deleted
    runs.finish_cold(1, "criu dump")
    _assert_clean(cfg)


@pytest.mark.parametrize("when", ["in-criu-restore", "before-wake"])
def test_engine_killed_during_a_restore(runs: Runs, when: str) -> None:
    cfg = runs.cfg
    first = runs.stop_run0()
    first.wait(timeout=120)
    saved = _settled(cfg)
    assert saved["state"] == "saved", (saved, runs.log(0))
    pid = int(saved["pid"])
    second = runs.start(1)
    if when == "in-criu-restore":  # the pid exists again: CRIU is rebuilding the process
        _wait("the restore to begin", lambda: Path(f"/proc/{pid}").exists(), 120)
    else:
        _wait("the restore to end", lambda: _status(cfg).get("state") != "saved", 120)
    os.kill(pid, signal.SIGKILL)
    assert second.wait(timeout=120) == 0, runs.log(1)  # the proxy noticed, did not hang
    log1 = runs.log(1)
    print(f"{when}: run 1 said:\n{log1[: log1.find(chr(10) + '{')]}")
    assert _job_dirs(cfg) == []  # single use: never restored twice
    # the restore failed, or the restored process died before it was done: either way
    # run 1 carries on from a cold start in the same run and answers everything
    assert runs.summary(1)["pending_left"] == 0 and "starts anew" in log1, log1
    answers = _answers(runs.tmp)
    cold = cold_answers(runs.model, runs.prompts, MAX_NEW)
    assert [answers[f"q{i:02d}"] for i in range(N_REQ)] == cold
    _assert_clean(cfg)


def test_a_damaged_pool_entry_after_the_dump_is_never_served(runs: Runs) -> None:
    """A whole tensor of the pool entry overwritten after the dump (the restored process
    maps the entry): its check prompt answers otherwise than before the checkpoint, so it
    ends without answering, and the run starts cold (the entry checked, found damaged
    and removed, and imported again from the model's files: whole); every answer is the
    cold model's."""
    from tests.helpers.damage import reverse_largest_tensor

    pool, entry = runs.saved_entry()
    data = pool.data_path(entry.manifest)
    times = os.stat(data)
    tensor = reverse_largest_tensor(pool, entry.manifest)
    # its file's times as they were (as failing memory would leave them): the run's start
    # sees the entry's seal unbroken; the check prompt is what catches it
    os.utime(data, ns=(times.st_atime_ns, times.st_mtime_ns))
    runs.finish_cold(1, "this run imported it again from")
    log1 = runs.log(1)
    assert f"tensor {tensor.name!r}" in log1 and "removed from the pool" in log1, log1
    assert "starts anew: the restored instance (pid " in log1, log1  # its stand-in says why
    assert ") failed its check prompt and ended (" in log1, log1
    (again,) = pool.entries()  # the same weights, whole again
    assert again.manifest.digest == entry.manifest.digest
    pool.verify(again.manifest.digest)
    # the restored instance wrote to the job's first log (its output is run 0's)
    assert "the restored instance does not serve: it answered the check prompt with" in \
        runs.log(0), runs.log(0)  # fmt: skip


def test_a_pool_entry_written_over_after_the_dump_is_mended_before_the_restore(
    runs: Runs,
) -> None:
    """A write onto the entry's file after the dump breaks its seal: the requeued run's
    start has it read, removed (damaged) and imported again from the model's files before
    the restore, so the restored process maps whole weights again: it passes its check and
    serves, and every answer is the cold model's."""
    from tests.helpers.damage import reverse_largest_tensor

    pool, entry = runs.saved_entry()
    tensor = reverse_largest_tensor(pool, entry.manifest)
    os.utime(pool.data_path(entry.manifest), ns=(0, 1))  # (a write may fall in its tick)
    proc = runs.start(1)
    assert proc.wait(timeout=300) == 0, runs.log(1)
    log1 = runs.log(1)
    assert f"spswap serve: pool entry model ({entry.manifest.digest[:12]}): tensor " \
        f"{tensor.name!r}" in log1 and "removed from the pool" in log1, log1  # fmt: skip
    assert "restored from its image" in log1 and "starts anew" not in log1, log1
    assert "its check prompt answered as before" in runs.log(0), runs.log(0)
    (again,) = pool.entries()
    pool.verify(again.manifest.digest)
    answers = _answers(runs.tmp)
    cold = cold_answers(runs.model, runs.prompts, MAX_NEW)
    assert [answers[f"q{i:02d}"] for i in range(N_REQ)] == cold
    # (root's run writes the pool itself: spswapd's pool.damaged event for a user's run is
    # tests/security/test_pool_check.py's)


NO_ROOM = "free on the file system of the images"


def test_tiny_tmpfs_full_during_a_dump(runs: Runs) -> None:
    """The images' file system (1 MiB) has no room for the image: the dump is refused
    before CRIU writes a byte (spswap.daemon.image_room), the run resumes and saves its
    requests, and the next run starts cold, saying why."""
    cfg = runs.cfg
    first = runs.stop_run0()
    assert first.wait(timeout=120) == 0, runs.log(0)  # resumed; exits with requests saved
    status = _settled(cfg)
    assert status["state"] == "failed", status
    assert status["reason"].startswith(f"no room for job {JOB}'s image: its image (about ")
    assert NO_ROOM in status["reason"], status
    assert "no checkpoint image" in runs.log(0)
    assert _job_dirs(cfg) == []
    assert runs.summary(0)["pending_left"] > 0
    runs.finish_cold(1, NO_ROOM)
    _assert_clean(cfg)


def test_image_holds_its_pool_entry_until_the_job_ends(runs: Runs) -> None:
    cfg = runs.cfg
    runs.stop_run0().wait(timeout=120)
    assert _settled(cfg)["state"] == "saved"
    daemon = lifecycle.daemon_running(cfg)
    assert _daemon_uses(cfg) == [daemon]  # the image's use, held by the daemon
    # a daemon killed -9 takes its uses back when it starts again
    os.kill(daemon, signal.SIGKILL)
    _wait("the daemon to die", lambda: not lifecycle.daemon_running(cfg), 10)
    assert _daemon_uses(cfg) == []
    daemon = _start_daemon(cfg)
    assert _daemon_uses(cfg) == [daemon]
    client = Client(cfg)
    kept = client.call("job.end", job_id=JOB, requeued=True)
    assert kept["fate"] == "back" and kept["images_deleted"] == []
    assert len(_job_dirs(cfg)) == 1 and _daemon_uses(cfg) == [daemon]
    gone = client.call("job.end", job_id=JOB, requeued=False)
    assert gone["fate"] == "gone" and len(gone["images_deleted"]) == 1
    assert _status(cfg)["state"] == "deleted"
    _assert_clean(cfg)


@pytest.mark.parametrize(("state", "requeued", "fate"), [
    ("PENDING", None, "back"), ("REQUEUED", False, "back"), ("REQUEUE_HOLD", None, "back"),
    ("COMPLETED", True, "gone"), ("CANCELLED by 0", None, "gone"), ("TIMEOUT", None, "gone"),
    ("COMPLETING", None, "unknown"), ("COMPLETING", True, "back"), ("COMPLETING", False, "gone"),
    (None, None, "unknown"), (None, True, "back"), (None, False, "gone"),
])  # fmt: skip
def test_job_fate(state: str | None, requeued: bool | None, fate: str) -> None:
    from spswap.slurm.parse import job_fate

    assert job_fate(state, requeued) == fate


@pytest.mark.parametrize(("slurm_restarts", "run_restart_count", "fate"), [
    (1, 0, "back"), (3, 2, "back"), (0, 0, "unknown"), (2, 2, "unknown"), (1, None, "unknown"),
])  # fmt: skip
def test_a_completing_job_whose_restart_count_went_up_comes_back(
    slurm_restarts: int, run_restart_count: int | None, fate: str
) -> None:
    """At the epilog of a requeued job Slurm 22.05 still says COMPLETING, as for an end for
    good; only its restart count, raised at the requeue, tells them apart."""
    from spswap.slurm.parse import job_fate

    assert job_fate("COMPLETING", None, slurm_restarts, run_restart_count) == fate


@pytest.fixture
def job_cgroup(runs: Runs) -> Iterator[Path]:
    """A stand-in for Slurm's job cgroup, beside this test's own (and spswapd's); after
    the test, none of this test's spswapd's parked cgroups (its root's tag: another
    spswapd on the host may be parking its own meanwhile) is left."""
    from spswap.checkpoint.cgroups import PREFIX, root_tag

    from .test_cgroups import HIERARCHY, stand_in_job_cgroup

    with stand_in_job_cgroup("spswap-fault-job") as path:
        yield path
    assert HIERARCHY is not None
    leftovers = list(HIERARCHY[1].glob(f"{PREFIX}{root_tag(runs.cfg.root)}-*"))
    assert leftovers == [], "spswapd leaves no parked cgroup behind"


def _job_events(cfg: Config) -> list[dict]:
    from spswap.daemon import events

    return [e for e in events.tail(cfg.paths.events, 500) if e.get("job_id") == JOB]


def _assert_answers_like_cold(runs: Runs) -> None:
    answers = _answers(runs.tmp)
    cold = cold_answers(runs.model, runs.prompts, MAX_NEW)
    assert [answers[f"q{i:02d}"] for i in range(N_REQ)] == cold


def _assert_joined(cfg: Config, pid: int) -> None:
    from .test_cgroups import HIERARCHY

    joined = [e for e in _job_events(cfg) if e["kind"] == "restore.joined_job"]
    assert HIERARCHY is not None and joined, _job_events(cfg)
    assert joined[0]["detail"] == {"pid": pid, "hierarchies": [HIERARCHY[0] or "v2"]}


def _kept_and_frozen(cfg: Config, first: subprocess.Popen) -> dict:
    """Run 0 dumped and kept: alive, frozen in its parked cgroup, its image on disk."""
    status = _settled(cfg)
    assert status["state"] == "saved" and status["kept"] is True, status
    assert status["pid"] == first.pid and first.poll() is None
    kinds = [e["kind"] for e in _job_events(cfg)]
    assert "checkpoint.parked" in kinds and "checkpoint.kept" in kinds, kinds
    assert len(_job_dirs(cfg)) == 1
    from .test_cgroups import _where

    assert "spswap-parked-" in _where(first.pid)
    return status


def test_a_run_in_a_job_cgroup_is_kept_frozen_and_woken_into_the_next(
    runs: Runs,
    job_cgroup: Path,
) -> None:
    """The dump runs with the tree outside its job's cgroup and leaves it alive there,
    frozen; the next run gets it back without CRIU's restore, in its own cgroup (where it
    answers from); the image is gone then and no parked cgroup is left."""
    cfg = runs.cfg
    runs.cgroup = job_cgroup
    first = runs.stop_run0()
    status = _kept_and_frozen(cfg, first)
    second = runs.start(1)
    assert second.wait(timeout=300) == 0, runs.log(1)
    assert first.wait(timeout=60) == 0, runs.log(0)  # it served run 1, then exited idle
    done = [e for e in _job_events(cfg) if e["kind"] == "restore.done"]
    assert done and done[0]["detail"]["kept"] is True, _job_events(cfg)
    assert "criu_restore" not in done[0]["detail"]["timings_s"]
    assert "restored from its kept instance (no CRIU restore) into run 1" in runs.log(0)
    _assert_joined(cfg, status["pid"])
    _assert_answers_like_cold(runs)
    _assert_clean(cfg)


def test_a_run_larger_than_the_keep_budget_is_not_kept_and_comes_back_from_its_image(
    runs: Runs,
    job_cgroup: Path,
) -> None:
    """SPSWAP_KEEP_BYTES=1: no tree fits, so the parked dump ends it as without keeping;
    CRIU restores the image into the next run."""
    cfg = runs.cfg
    runs.cgroup = job_cgroup
    first = runs.stop_run0()
    status = _settled(cfg)
    assert status["state"] == "saved" and status["kept"] is False, status
    assert first.wait(timeout=30) == -signal.SIGKILL  # reaped: its pid is free for CRIU
    kinds = [e["kind"] for e in _job_events(cfg)]
    assert "checkpoint.parked" in kinds and "checkpoint.kept" not in kinds, kinds
    (why,) = [e["detail"]["reason"] for e in _job_events(cfg) if e["kind"] == "checkpoint.not_kept"]
    assert "more than SPSWAP_KEEP_BYTES (1 B) keeps alive: its image brings it back" in why, why
    second = runs.start(1)
    assert second.wait(timeout=300) == 0, runs.log(1)
    _assert_restored_early(cfg, status["pid"])
    assert "restored from its image as pid" in runs.log(1)
    _assert_answers_like_cold(runs)
    _assert_clean(cfg)


def _assert_restored_early(cfg: Config, pid: int) -> None:
    """The image was restored at the run's start (its `job.starting`: no prolog here) into
    the parked cgroup its dump left, and the run took it as restored from its image; no
    parked cgroup is left."""
    events = _job_events(cfg)
    early = [e for e in events if e["kind"] == "restore.restored_early"]
    assert early and early[0]["detail"]["pid"] == pid, events
    done = [e for e in events if e["kind"] == "restore.done"]
    assert done and done[0]["detail"]["kept"] is False, events
    assert {"early_criu_restore", "early_verify"} <= set(done[0]["detail"]["timings_s"]), done
    assert _parked_cgroups(cfg) == []


def _parked_cgroups(cfg: Config) -> list[str]:
    from spswap.checkpoint import cgroups

    tag = f"{cgroups.PREFIX}{cgroups.root_tag(cfg.root)}-"
    return sorted(p.name for base in cgroups.own_dirs(cgroups.mounts()).values()
                  for p in base.glob(f"{tag}*"))  # fmt: skip


def test_a_kept_run_ends_with_its_job(runs: Runs, job_cgroup: Path) -> None:
    cfg = runs.cfg
    runs.cgroup = job_cgroup
    first = runs.stop_run0()
    _kept_and_frozen(cfg, first)
    client = Client(cfg)
    back = client.call("job.end", job_id=JOB, requeued=True)
    assert back["fate"] == "back" and first.poll() is None  # still kept for the next run
    gone = client.call("job.end", job_id=JOB, requeued=False)
    assert gone["fate"] == "gone" and len(gone["images_deleted"]) == 1
    assert first.wait(timeout=30) == -signal.SIGKILL
    assert "kept.ended" in [e["kind"] for e in _job_events(cfg)]  # logged before the answer
    _assert_clean(cfg)


def test_with_no_keep_a_parked_run_is_dumped_and_restored_into_the_next(
    runs: Runs,
    job_cgroup: Path,
) -> None:
    """SPSWAP_KEEP_BYTES=0: the dump ends the parked tree; CRIU restores it into the next
    run's cgroup (where it answers from), and no parked cgroup is left."""
    cfg = runs.cfg
    runs.cgroup = job_cgroup
    first = runs.stop_run0()
    status = _settled(cfg)
    assert status["state"] == "saved" and status["kept"] is False, status
    first.wait(timeout=60)  # CRIU ended it: reaped, its pid is free for the restore
    parked = [e for e in _job_events(cfg) if e["kind"] == "checkpoint.parked"]
    assert parked and parked[0]["detail"]["pids"] == [status["pid"]], _job_events(cfg)
    (why,) = [e["detail"]["reason"] for e in _job_events(cfg) if e["kind"] == "checkpoint.not_kept"]
    assert why.startswith("SPSWAP_KEEP_BYTES is 0: no instance is kept alive"), why
    # a stand-in job cgroup has no device rules (Slurm's ConstrainDevices would)
    assert parked[0]["detail"]["device_rules"] == "not needed", parked
    assert _parked_cgroups(cfg) != [], "held for the image's early restore"
    second = runs.start(1)
    assert second.wait(timeout=300) == 0, runs.log(1)
    _assert_joined(cfg, status["pid"])
    _assert_restored_early(cfg, status["pid"])
    _assert_answers_like_cold(runs)
    _assert_clean(cfg)


def _dumped_not_kept(runs: Runs, job_cgroup: Path) -> dict:
    """Run 0, in a stand-in job cgroup, stopped and dumped to an image (not kept); its
    process reaped (its pids free for a restore); the job's checkpoint status."""
    runs.cgroup = job_cgroup
    first = runs.stop_run0()
    status = _settled(runs.cfg)
    assert status["state"] == "saved" and status["kept"] is False, status
    first.wait(timeout=60)
    return status


def test_with_no_keep_an_image_restored_early_that_no_run_takes_ends_with_its_job(
    runs: Runs,
    job_cgroup: Path,
) -> None:
    """A run's start restores the image early; when no run takes the tree (it started
    cold, or never asked), the job's end ends it and the image stays: the next run is
    restored from it."""
    cfg = runs.cfg
    status = _dumped_not_kept(runs, job_cgroup)
    client = Client(cfg)
    assert client.call("job.starting", job_id=JOB)["waking"] is True  # and then no run asks
    _wait("the early restore", lambda: any(
        e["kind"] == "restore.restored_early" for e in _job_events(cfg)), 60)  # fmt: skip
    assert _proc_state(status["pid"]).startswith("State:"), "restored, frozen"
    assert client.call("job.end", job_id=JOB, requeued=True)["fate"] == "back"
    ended = [e for e in _job_events(cfg) if e["kind"] == "kept.ended"]
    assert ended and "restored early for its job's run, which did not take it" in \
        ended[0]["detail"]["reason"], _job_events(cfg)  # fmt: skip
    _wait("the tree to end", lambda: _proc_state(status["pid"]) == "gone", 30)
    assert len(_job_dirs(cfg)) == 1 and _parked_cgroups(cfg) == []  # the image stays
    client.call("job.register", job_id=JOB, uid=0, user="root", restart_count=1)
    second = runs.start(1)
    assert second.wait(timeout=300) == 0, runs.log(1)
    assert "restored from its image as pid" in runs.log(1)
    _assert_answers_like_cold(runs)
    _assert_clean(cfg)


def test_with_no_keep_an_image_crius_early_restore_fails_on_gives_a_cold_start_with_why(
    runs: Runs,
    job_cgroup: Path,
) -> None:
    """An image whose files keep their sizes but not their bytes passes the quick check;
    CRIU's early restore of it fails: the image is deleted (never tried twice), and the
    run starts cold, says why and answers everything as the cold model does."""
    cfg = runs.cfg
    _dumped_not_kept(runs, job_cgroup)
    (image,) = [cfg.paths.images / d for d in _job_dirs(cfg)]
    mm = next(image.glob("mm-*.img"))  # (not core-*: its credentials are read first)
    mm.write_bytes(b"\xff" * mm.stat().st_size)  # same size: the layout still holds
    runs.finish_cold(1, "criu restore of")
    kinds = [e["kind"] for e in _job_events(cfg)]
    assert "restore.restored_early" not in kinds and "restore.failed" in kinds, kinds
    assert _parked_cgroups(cfg) == []
    _assert_clean(cfg)


def test_with_no_keep_a_held_cgroup_gone_before_the_early_restore_leaves_the_image_whole(
    runs: Runs,
    job_cgroup: Path,
) -> None:
    """The parked cgroup the dump left is gone (an admin's cleanup) when the run starts:
    CRIU cannot start inside it, so nothing is restored early, the event says why, and
    the image is untouched: the run restores it itself and answers as the cold model."""
    from spswap.checkpoint import cgroups

    cfg = runs.cfg
    status = _dumped_not_kept(runs, job_cgroup)
    tag = f"{cgroups.PREFIX}{cgroups.root_tag(cfg.root)}-"
    held = [p for base in cgroups.own_dirs(cgroups.mounts()).values() for p in base.glob(f"{tag}*")]
    assert held, "the dump holds its parked cgroup for the early restore"
    for d in held:
        d.rmdir()
    # the early restore first, as a run's start asks for it: the run's own restore may
    # otherwise take the image before the early one looks (then it has nothing to say;
    # seen once in CI on a loaded machine)
    Client(cfg).call("job.starting", job_id=JOB)
    _wait("the early restore's refusal", lambda: any(
        e["kind"] == "restore.not_restored_early" for e in _job_events(cfg)), 60)  # fmt: skip
    second = runs.start(1)
    assert second.wait(timeout=300) == 0, runs.log(1)
    events = _job_events(cfg)
    why = [e["detail"]["reason"] for e in events if e["kind"] == "restore.not_restored_early"]
    assert why and "CRIU could not be started inside the cgroup(s)" in why[0], events
    assert "restore.restored_early" not in [e["kind"] for e in events], events
    assert f"restored from its image as pid {status['pid']}" in runs.log(1), runs.log(1)
    _assert_answers_like_cold(runs)
    _assert_clean(cfg)


def test_tiny_tmpfs_full_during_a_parked_dump_sends_the_run_home(
    runs: Runs,
    job_cgroup: Path,
) -> None:
    """A parked dump that fails (no Slurm here, so no early requeue): the instance goes
    back into its job's cgroup and runs on, its requests saved."""
    cfg = runs.cfg
    runs.cgroup = job_cgroup
    first = runs.stop_run0()
    assert first.wait(timeout=120) == 0, runs.log(0)  # resumed; exits with requests saved
    status = _settled(cfg)
    assert status["state"] == "failed" and NO_ROOM in status["reason"], status
    assert "was ended" not in status["reason"]
    kinds = [e["kind"] for e in _job_events(cfg)]
    assert "checkpoint.parked" in kinds and "job.requeue" not in kinds, kinds
    assert "no checkpoint image" in runs.log(0)
    runs.finish_cold(1, NO_ROOM)
    _assert_clean(cfg)
