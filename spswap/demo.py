"""``spswap demo``: the main job on this machine. A few small reference models take turns
on one device through a real spswapd started on a temporary root.

No Slurm: the demo plays each model's job itself, the way the tests' stand-in jobs do.
A run of a job is ``spswap serve`` started with ``SLURM_JOB_ID`` and
``SLURM_RESTART_COUNT`` set (registered with spswapd as root, as the prolog would); a
turn stops the running model's run with SIGTERM (as Slurm's requeue does), waits until
it is put away, and starts the incoming model's next run, which restores it (CRIU: kept
alive or from its image, as spswapd's keep budget decides) or, without CRIU, starts a new
server from the pool. The turn plan, measurement, summary and table are those of
``spswap bench turns``; Slurm's share is the demo's own stop + start.
"""

from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from spswap import __version__
from spswap.bench.turns import leftovers
from spswap.bench.turns_ask import SpoolAsker
from spswap.bench.turns_plan import (
    PlannedTurn,
    TurnKind,
    TurnResult,
    TurnsSummary,
    measure_turn,
    plan_turns,
    summarize,
)
from spswap.checkpoint import criu
from spswap.config import Config
from spswap.daemon import lifecycle
from spswap.daemon.client import Client
from spswap.demo_report import DemoMode, choose_mode, explain_slower
from spswap.errors import ConfigError, SpswapError
from spswap.serve.run_log import read_runs

PROMPT = [11, 23, 5, 42, 7, 19, 3, 31]
MAX_NEW_TOKENS = 8
JOB_BASE = 9100  # the demo's daemon is its own: any ids do; numeric, as Slurm's are
STOP_TIMEOUT_S = 120.0
TURN_TIMEOUT_S = 300.0


SLURM_COMMANDS = ("scontrol", "squeue", "scancel", "sbatch", "srun", "sinfo", "sacct")


def path_without_slurm(path: str, shadow: Path) -> str:
    """``path`` with Slurm's commands hidden: each directory that holds one is replaced by
    ``shadow/<n>``, a copy of it made of symlinks, less Slurm's commands. The demo's node
    has no Slurm: its daemon and runs must not wait on a controller that is not there
    (where Slurm's commands are installed but no controller runs, every question to it
    costs its timeout)."""
    out = []
    for n, entry in enumerate(path.split(os.pathsep)):
        d = Path(entry or ".")
        try:
            has_slurm = any((d / cmd).exists() for cmd in SLURM_COMMANDS)
            items = list(d.iterdir()) if has_slurm else []
        except OSError:  # a directory this user may not search (root's PATH under /root)
            continue
        if not has_slurm:
            out.append(entry)
            continue
        copy = shadow / str(n)
        copy.mkdir(parents=True, exist_ok=True)
        for item in items:
            if item.name not in SLURM_COMMANDS:
                (copy / item.name).symlink_to(item)
        out.append(str(copy))
    return os.pathsep.join(out)


def detect_mode() -> DemoMode:
    """CRIU where this process is root and a CRIU >= 4.1 is found, else the pool."""
    setting = criu.criu_setting()  # the settings file read once
    path = criu.find_criu(setting=setting)
    version = None
    if path is not None:
        try:
            version = criu.criu_version(path)
        except SpswapError:
            version = None
    return choose_mode(os.geteuid(), str(path) if path else None, version, criu.MIN_VERSION,
                       setting)  # fmt: skip


@dataclass
class DemoJob:
    """One model's stand-in Slurm job: its runs, one ``spswap serve`` process each."""

    name: str
    job_id: str
    model: Path
    state: Path
    log_dir: Path
    runs: int = 0  # runs started so far: the next run's SLURM_RESTART_COUNT
    proc: subprocess.Popen | None = None  # the current run's process
    restored: bool = False  # the current run restored an instance (it is a stand-in)
    run_started_s: float = 0.0  # epoch seconds the current run was started
    old: list[subprocess.Popen] = field(default_factory=list)  # reaped as they end

    def log(self, run: int) -> Path:
        return self.log_dir / f"{self.name}-run{run}.log"

    def tail(self, run: int, lines: int = 8) -> str:
        try:
            text = self.log(run).read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n  ".join(text.splitlines()[-lines:])


@dataclass
class DemoRun:
    """The demo's temporary node: root, daemon, models and jobs; :meth:`close` removes all."""

    mode: DemoMode
    preset: str
    work: Path
    cfg: Config
    device: str = "cpu"
    say: Callable[[str], None] = lambda _msg: None
    jobs: list[DemoJob] = field(default_factory=list)
    cold_answers: dict[str, list[int]] = field(default_factory=dict)
    last_answer_s: float = 0.0
    copies_gb_per_s: list[float] = field(default_factory=list)  # each pool -> device start
    path: str = field(default_factory=lambda: os.environ.get("PATH", os.defpath))

    def setup(self, models: int) -> None:
        from spswap.engines.reference import save_checkpoint
        from spswap.engines.reference_model import preset as make_preset

        for i in range(models):
            cfg = make_preset(self.preset, seed=i)
            name = f"model-{i}"
            self.say(f"writing {name} ({self.preset}, seed {i}) as safetensors")
            model = save_checkpoint(cfg, self.work / "models" / name)
            self.jobs.append(
                DemoJob(
                    name, str(JOB_BASE + i), model, self.work / "state" / name, self.work / "logs"
                )
            )
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        self.path = path_without_slurm(self.path, self.work / "bin")
        self.say(f"starting spswapd on {self.cfg.root}")
        before = os.environ.get("PATH")
        os.environ["PATH"] = self.path  # the daemon's environment is this process's
        try:
            lifecycle.start(self.cfg, wait_s=30.0)
        finally:
            if before is None:
                del os.environ["PATH"]
            else:
                os.environ["PATH"] = before

    def _client(self):  # noqa: ANN202 - a daemon client, imported late
        return Client(self.cfg, timeout_s=30.0)

    def _status(self, job: DemoJob) -> str | None:
        if not self.mode.checkpoint:
            return None
        return str(self._client().call("checkpoint.status", job_id=job.job_id).get("state"))

    def _reap(self) -> None:
        # a kept instance is the demo's child until CRIU ends it: reap it, or its zombie
        # would look alive to the run standing in for it
        for job in self.jobs:
            job.old = [p for p in job.old if p.poll() is None]

    # -- a run of a job --------------------------------------------------------------
    def start_run(self, job: DemoJob) -> None:
        """The job's next run, as Slurm would start it (the prolog registers it)."""
        if self.mode.checkpoint:
            self._client().call("job.register", job_id=job.job_id, uid=os.geteuid(),
                                user="root", restart_count=job.runs)  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(PATH=self.path, SPSWAP_ROOT=str(self.cfg.root))
        if self.mode.checkpoint or os.geteuid() == 0:
            # a user's run may not name a job no prolog registered (only root registers
            # one): on the pool path it needs none
            env.update(SLURM_JOB_ID=job.job_id, SLURM_RESTART_COUNT=str(job.runs))
        argv = [sys.executable, "-m", "spswap.cli", "serve", str(job.model), "--state-dir",
                str(job.state), "--device", self.device]  # fmt: skip
        if not self.mode.checkpoint:
            argv.append("--no-checkpoint")
        job.run_started_s = time.time()
        with open(job.log(job.runs), "w") as out:  # a regular file, as a job's output is
            job.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)  # fmt: skip
        job.runs += 1

    def stop_run(self, job: DemoJob) -> None:
        """Stop the job's run as Slurm's requeue would (SIGTERM) and wait until it is put
        away: dumped (kept or image) with CRIU, ended otherwise; then the epilog."""
        proc = job.proc
        assert proc is not None
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while True:
            self._reap()
            state = self._status(job)
            if state == "saved" or (proc.poll() is not None and state != "dumping"):
                break
            if time.monotonic() > deadline:
                raise SpswapError(
                    f"{job.name} (job {job.job_id}) was not put away within "
                    f"{STOP_TIMEOUT_S:g} s of SIGTERM; its log "
                    f"{job.log(job.runs - 1)}:\n  {job.tail(job.runs - 1)}"
                )
            time.sleep(0.01)
        if job.restored and proc.poll() is None:
            # the stand-in waits on a kept (frozen) instance: Slurm ends the job's run here
            proc.kill()
            proc.wait()
        elif proc.poll() is None:
            job.old.append(proc)  # the kept instance itself: it must live on
        job.proc = None
        if self.mode.checkpoint:
            self._client().call("job.end", job_id=job.job_id, requeued=True)

    # -- a turn ----------------------------------------------------------------------
    def run_turn(self, turn: PlannedTurn, asker: SpoolAsker) -> TurnResult:
        job = self.jobs[turn.model]
        request_id = f"turn{turn.index + 1:03d}"  # the table's and the JSON's number
        asker.prepare(job.state, request_id)  # waits in the inbox before the action
        action_s = time.time()
        if turn.displaced is not None:
            self.stop_run(self.jobs[turn.displaced])
        run = job.runs
        self.start_run(job)

        def check() -> None:
            self._reap()
            assert job.proc is not None
            if job.proc.poll() is not None:
                raise SpswapError(f"{job.name}'s run {run} ended (status "
                                  f"{job.proc.returncode}) before it answered; its log "
                                  f"{job.log(run)}:\n  {job.tail(run)}")  # fmt: skip

        answer = asker.wait(job.state, request_id, time.monotonic() + TURN_TIMEOUT_S, check)
        self.last_answer_s = answer.answered_s
        # this run's line (a user's pool-path runs name no job, so no restart count): the
        # one written by a process started after the run was (the start has a 10 ms tick)
        records = [r for r in read_runs(job.state) if r.started_s >= job.run_started_s - 0.02]
        record = records[-1] if records else None
        path = record.path.value if record else "unknown"
        job.restored = path in ("kept", "image")
        if turn.kind is TurnKind.COLD:
            self.cold_answers[job.name] = answer.output_ids
        reason = record.reason if record and turn.kind is TurnKind.RESTORE else None
        if record is None:
            reason = f"no line for run {run} in {job.state / 'runs.jsonl'}"
        result = measure_turn(turn, job.name, action_s=action_s,
                              run_started_s=record.started_s if record else action_s,
                              answered_s=answer.answered_s, path=path,
                              identical=answer.output_ids == self.cold_answers.get(job.name),
                              reason=reason)  # fmt: skip
        # a start from the pool (a cold start's first copy follows its import: not one)
        copy = record.copy_gb_per_s if record and path == "pool" else None
        if copy is not None:
            self.copies_gb_per_s.append(copy)
        self.say(
            f"turn {turn.index + 1} (round {turn.round}) {job.name}: {path} "
            f"{result.total_s:.2f} s"
            + (f" (weights from the pool at {copy:.1f} GB/s)" if copy is not None else "")
            + ("" if result.identical else " ANSWER DIFFERS")
        )
        return result

    # -- afterwards ------------------------------------------------------------------
    def leftovers(self) -> list[str]:
        """What the node still holds for the demo's jobs once they have ended."""
        # the demo plays Slurm itself: no queue to ask
        return leftovers(self.cfg, None, [j.job_id for j in self.jobs])

    def close(self) -> list[str]:
        """End every job (the last running one is stopped first), stop the daemon; what
        was left over before the daemon stopped."""
        left: list[str] = []
        try:
            for job in self.jobs:
                if job.proc is not None and job.proc.poll() is None:
                    try:
                        self.stop_run(job)
                    except SpswapError as e:
                        left.append(str(e))
                if self.mode.checkpoint:
                    self._client().call("job.end", job_id=job.job_id, requeued=False)
            if self.mode.checkpoint:
                left += self._wait_leftovers()
        finally:
            for job in self.jobs:
                for proc in [*job.old, *([job.proc] if job.proc else [])]:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
            lifecycle.stop(self.cfg, timeout_s=10.0)
        return left

    def _wait_leftovers(self, wait_s: float = 30.0) -> list[str]:
        deadline = time.monotonic() + wait_s
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left


SOCKET_MAX = 107  # bytes in a Unix socket's path
TEMP_PREFIX = "spswap-demo-"  # + 8 characters from mkdtemp
NODE = "n"  # the daemon's root in the temporary folder: short, for its socket's path


def _work_parent(parent: Path | None) -> Path:
    """Where the temporary node goes: ``parent``, else /dev/shm (memory: images and pool
    at memory speed) when it is there and writable, else /tmp. The daemon's socket path
    must fit a Unix socket: a parent too deep is refused, saying how deep may do."""
    if parent is None:
        shm = Path("/dev/shm")
        return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path("/tmp")
    parent.mkdir(parents=True, exist_ok=True)
    tail = len(f"/{TEMP_PREFIX}12345678/{NODE}/run/spswapd.sock")
    if len(os.fsencode(str(parent.resolve()))) + tail > SOCKET_MAX:
        raise ConfigError(f"--root {parent} is too deep for spswapd's socket: give one of "
                          f"at most {SOCKET_MAX - tail} bytes, e.g. /tmp")  # fmt: skip
    return parent


def run_demo(*, models: int = 3, rounds: int = 2, preset: str = "small",
             device: str | None = None, root: Path | None = None,
             max_new_tokens: int = MAX_NEW_TOKENS, mode: DemoMode | None = None,
             progress: Callable[[str], None] | None = None
             ) -> tuple[TurnsSummary, DemoMode]:  # fmt: skip
    """The whole demo; everything it writes lives under a temporary folder in ``root``
    (default /dev/shm) that is removed at the end, with the daemon it started."""
    from spswap.engines.reference_model import preset as make_preset

    plan = plan_turns(models, rounds)  # the bench's errors for K < 2 or R < 1
    make_preset(preset)  # an unknown preset is refused before anything starts
    mode = mode or detect_mode()
    say = progress or (lambda _msg: None)
    if mode.note:
        say(mode.note)
    if device is None:
        from spswap.engines.reference import default_device

        device = default_device()  # this machine's device: its GPU where it has one
    dev = device
    work = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=_work_parent(root).resolve()))
    os.chmod(work, 0o755)  # the daemon's root is under it: users traverse to the socket
    run = DemoRun(mode, preset, work, Config.from_env({}, root=work / NODE), device=dev,
                  say=say)  # fmt: skip
    asker = SpoolAsker(PROMPT, max_new_tokens)
    results: list[TurnResult] = []
    first_round_s: float | None = None
    try:
        run.setup(models)
        for turn in plan:
            if turn.kind is TurnKind.RESTORE and first_round_s is None:
                first_round_s = time.time()
            results.append(run.run_turn(turn, asker))
    finally:
        left = run.close()
        shutil.rmtree(work, ignore_errors=True)
    wall_s = run.last_answer_s - first_round_s if first_round_s else 0.0
    settings = {"mode": mode.name, "device": dev, "preset": preset, "rounds": rounds,
                "model_count": models, "max_new_tokens": max_new_tokens, "spswap": __version__,
                "python": platform.python_version(), "host": platform.node(),
                "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    if run.copies_gb_per_s:  # the slowest start from the pool: memory speed, or faults?
        settings["pool_copy_gb_per_s_min"] = round(min(run.copies_gb_per_s), 2)
    turns = explain_slower(results, mode, cores=os.cpu_count(), load=os.getloadavg()[0])
    return summarize([j.name for j in run.jobs], turns,
                     wall_s=max(0.0, wall_s), settings=settings, leftovers=left,
                     job_ids={j.name: j.job_id for j in run.jobs},
                     restored_paths=mode.restored_paths), mode  # fmt: skip
