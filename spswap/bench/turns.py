"""``spswap bench turns``: K models take turns on one device through the real product.

Each model is served by ``spswap serve`` (the template ``spswap`` ships, rendered by
:func:`spswap.serve.sbatch.render_serve`) as its own requeueable Slurm job, submitted
held. A turn is one Slurm action: the incoming model's job is released and the running
one is requeued held (``scontrol requeuehold``: Slurm stops it with SIGTERM; spswap parks
it and spswapd dumps it, kept alive or to an image as the keep budget decides); the
incoming job's run restores its instance (or starts cold, the first time) and answers
the question that waits for it. Nothing is resubmitted: the K jobs keep their ids and
stay requeueable all along.

Per turn: seconds from the action to the first answer, split at the moment the incoming
run's ``spswap serve`` started (its ``runs.jsonl`` line, which also says the path it
came up by) into Slurm's share and spswap's. Each model starts once first (cold, or
from the pool where an earlier run left its weights there); its answer there is the
reference every later answer is compared with.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spswap import __version__
from spswap.bench.prolog import current_user_name
from spswap.bench.turns_ask import Asker, OpenAiAsker, SpoolAsker
from spswap.bench.turns_plan import (
    PlannedTurn,
    TurnKind,
    TurnResult,
    TurnsSummary,
    measure_turn,  # fmt: skip
    plan_turns,
    summarize,
)
from spswap.bench.turns_report import turn_line
from spswap.checkpoint.service import images_of_job, temp_dirs
from spswap.config import Config
from spswap.daemon.client import Client
from spswap.daemon.lifecycle import ping
from spswap.errors import ConfigError, SpswapError
from spswap.fsutil import evict_page_cache
from spswap.pool.store import Pool
from spswap.serve.run_log import RunRecord, read_runs
from spswap.serve.sbatch import SbatchOptions, render_serve
from spswap.slurm.backend import controller_up
from spswap.slurm.jobctl import JobControl
from spswap.slurm.parse import job_fate

DEFAULT_PROMPT = [11, 23, 5, 42, 7, 19, 3, 31]
RUN_RECORD_WAIT_S = 10.0  # a restored process can answer before its proxy notes the run
CLEANUP_WAIT_S = 120.0


@dataclass(frozen=True)
class TurnsOptions:
    """What ``spswap bench turns`` was asked to do."""

    models: tuple[Path, ...]
    work_dir: Path  # job scripts, logs and state directories (must outlive the jobs)
    rounds: int = 3
    engine: str = "reference"
    partition: str = "low"
    gpus: int = 1
    units: int = 4
    time_limit: str = "01:00:00"
    vllm_args: str = ""
    serve_args: str = ""  # more `spswap serve` options, e.g. --kv-cache-gib 4
    prompt_ids: tuple[int, ...] = tuple(DEFAULT_PROMPT)
    max_new_tokens: int = 16
    turn_timeout_s: float = 600.0
    drop_cache: bool = True


@dataclass
class TurnJob:
    """One model's job."""

    name: str
    model: Path
    job_id: str = ""
    asker: Asker | None = None

    def state_dir(self, work_dir: Path) -> Path:
        return work_dir / ".spswap" / self.job_id


@dataclass
class TurnsRun:
    """One run of the bench: owns its jobs from submit to cancel."""

    opts: TurnsOptions
    cfg: Config
    log: Callable[[str], None] = print
    slurm: JobControl = field(default_factory=JobControl)
    jobs: list[TurnJob] = field(default_factory=list)
    cold_answers: dict[str, list[int]] = field(default_factory=dict)
    last_answer_s: float = 0.0  # epoch seconds of the latest turn's answer

    # -- before anything is submitted ------------------------------------------------
    def preflight(self) -> None:
        """Clear errors, naming what to run, before any job exists (Slurm's part is
        :func:`slurm_preflight`, which the command runs before it writes any model)."""
        names = [j.name for j in self.jobs]
        if len(set(names)) != len(names):
            raise ConfigError(f"two models share a name ({', '.join(names)}): give each "
                              "model its own directory name")  # fmt: skip

    def check_daemon(self) -> None:
        """After the first job ran (its prolog starts spswapd where none runs yet)."""
        if not ping(self.cfg):
            raise ConfigError(f"spswapd does not answer at {self.cfg.paths.socket} although a "
                              "job ran: the Slurm prolog starts it on each node "
                              "(docs/slurm.md), or run `spswap daemon start` as root; without "
                              "it no turn can restore")  # fmt: skip

    def make_jobs(self) -> None:
        self.jobs = [TurnJob(name=m.name, model=m) for m in self.opts.models]
        prompt = list(self.opts.prompt_ids)
        for job in self.jobs:
            job.asker = SpoolAsker(prompt, self.opts.max_new_tokens) \
                if self.opts.engine == "reference" else \
                OpenAiAsker(str(job.model), prompt, self.opts.max_new_tokens)  # fmt: skip

    def submit(self) -> None:
        """Every model's job, held: none runs until its first turn."""
        work = self.opts.work_dir
        if not work.exists():
            work.mkdir(parents=True, mode=0o700)
            work.chmod(0o700)  # the umask may have added group bits (Ubuntu's is 002)
        if work.stat().st_mode & 0o022:
            raise ConfigError(f"{work} is writable by others (mode "
                              f"{work.stat().st_mode & 0o777:o}): the jobs' state "
                              "directories must be private; chmod 700 it or give "
                              "another --work-dir")  # fmt: skip
        for i, job in enumerate(self.jobs):
            script = self.opts.work_dir / f"turns-{i}-{job.name}.sbatch"
            script.write_text(job_script(self.opts, job, i))
            job.job_id = self.slurm.submit(script, chdir=self.opts.work_dir, hold=True)
            self.log(f"bench turns: {job.name} is job {job.job_id} (held)")

    # -- the turns ---------------------------------------------------------------------
    def run_turn(self, turn: PlannedTurn) -> TurnResult:
        job = self.jobs[turn.model]
        assert job.asker is not None
        state = job.state_dir(self.opts.work_dir)
        request_id = f"turn{turn.index + 1:03d}"  # the table's and the JSON's number
        job.asker.prepare(state, request_id)
        if turn.kind is TurnKind.COLD and self.opts.drop_cache:
            evict_page_cache(job.model)  # so its cold start reads the disk
        action_s = time.time()
        self.slurm.release(job.job_id)
        if turn.displaced is not None:
            self.slurm.requeue_hold(self.jobs[turn.displaced].job_id)
        answer = job.asker.wait(state, request_id, time.monotonic() + self.opts.turn_timeout_s,
                                check=lambda: self._still_queued(job))  # fmt: skip
        self.last_answer_s = answer.answered_s
        run = self._run_record(state, action_s)
        if turn.kind is TurnKind.COLD:
            self.cold_answers[job.name] = answer.output_ids
        identical = answer.output_ids == self.cold_answers.get(job.name)
        path = run.path.value if run else "unknown"
        reason = run.reason if run and turn.kind is TurnKind.RESTORE else None
        if run is None:
            reason = f"no line in {state / 'runs.jsonl'} for this run"
        result = measure_turn(turn, job.name, action_s=action_s,
                              run_started_s=run.started_s if run else action_s,
                              answered_s=answer.answered_s, path=path, identical=identical,
                              reason=reason, eligible_s=self._eligible_s(job))  # fmt: skip
        self.log(turn_line(result))
        return result

    def _eligible_s(self, job: TurnJob) -> float | None:
        """When Slurm let the job start this run (None: Slurm did not say)."""
        try:
            info = self.slurm.job(job.job_id)
        except SpswapError:
            return None
        return info.eligible_s if info is not None else None

    def _still_queued(self, job: TurnJob) -> None:
        """Give up at once when the job has ended (it failed, or was cancelled): no answer
        can come; its log's last lines say why."""
        if job_gone(self.slurm, job.job_id) is not True:  # Slurm did not answer: wait on
            return
        log = self.opts.work_dir / f"turns-{self.jobs.index(job)}-{job.name}-{job.job_id}.log"
        try:
            tail = "\n  ".join(log.read_text(errors="replace").splitlines()[-6:])
        except OSError:
            tail = "(no log)"
        raise SpswapError(f"job {job.job_id} ({job.name}) ended before it answered; the "
                          f"last lines of {log}:\n  {tail}")  # fmt: skip

    def _run_record(self, state: Path, action_s: float) -> RunRecord | None:
        """The incoming job's run that started after the action (to the start time's
        10 ms tick)."""
        deadline = time.monotonic() + RUN_RECORD_WAIT_S
        while True:
            runs = [r for r in read_runs(state) if r.started_s >= action_s - 0.02]
            if runs:
                return runs[-1]
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)

    # -- afterwards ----------------------------------------------------------------------
    def cleanup(self) -> list[str]:
        """Cancel every job and wait until spswapd has let go of them; what is still held
        after ``CLEANUP_WAIT_S`` is reported, not hidden."""
        ids = [j.job_id for j in self.jobs if j.job_id]
        try:
            self.slurm.cancel_all(ids)
        except SpswapError as e:
            return [f"could not cancel jobs {', '.join(ids)}: {e}"]
        deadline = time.monotonic() + CLEANUP_WAIT_S
        while True:
            left = leftovers(self.cfg, self.slurm, ids)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.5)

    def settings(self) -> dict[str, Any]:
        return {"engine": self.opts.engine, "rounds": self.opts.rounds,
                "model_count": len(self.jobs), "partition": self.opts.partition,
                "gpus_per_job": self.opts.gpus, "max_new_tokens": self.opts.max_new_tokens,
                "spswap": __version__, "python": platform.python_version(),
                "host": platform.node(), "kernel": platform.release(),
                "user": current_user_name(), "work_dir": str(self.opts.work_dir),
                "date": time.strftime("%Y-%m-%d")}  # fmt: skip


def turns_serve_args(engine: str, kv_cache_gib: float | None, eager: bool) -> str:
    """The `spswap serve` options the bench adds to the template's line: vLLM's KV cache
    size, and --no-eager unless eager was asked (serve's default is eager)."""
    args = [f"--kv-cache-gib {kv_cache_gib:g}"] if kv_cache_gib else []
    if engine == "vllm" and not eager:
        args.append("--no-eager")
    return " ".join(args)


def job_script(opts: TurnsOptions, job: TurnJob, index: int) -> str:
    """The template users submit, for this model, with spswap's extra options."""
    script = render_serve(SbatchOptions(
        model=str(job.model), job_name=f"turns-{index}-{job.name}", partition=opts.partition,
        gpus=opts.gpus, units=opts.units, time_limit=opts.time_limit, engine=opts.engine,
        vllm_args=opts.vllm_args or SbatchOptions().vllm_args,
        serve_args=opts.serve_args))  # fmt: skip
    # the jobs run the spswap this bench runs (sbatch passes the environment on)
    return script.replace("\nMODEL=", f"\nexport PATH={Path(sys.executable).parent}:$PATH\n"
                          "MODEL=", 1)  # fmt: skip


def leftovers(cfg: Config, slurm: JobControl | None, job_ids: list[str]) -> list[str]:
    """What the node still holds for these jobs: queued jobs (``slurm`` None: no Slurm
    plays them, as in the demo), GPU slots, pool uses, and (as root, who alone may read
    the image directory) checkpoint images."""
    ids = set(job_ids)
    out = [f"job {j} still in the queue" for j in job_ids
           if slurm is not None and job_gone(slurm, j) is False]  # fmt: skip
    try:
        snap = Client(cfg, timeout_s=10.0).call("slots.list")
        out += [
            f"GPU slot {r['id']} of job {r['holder'].get('job_id')}"
            for r in snap.get("reservations", [])
            if r["holder"].get("job_id") in ids
        ]
    except SpswapError as e:
        out.append(f"could not ask spswapd for the GPU slots ({e})")
    out += kept_instances(cfg, job_ids)
    for entry in Pool.from_config(cfg).entries():
        out += [f"a use of pool entry {entry.manifest.name} by job {h.job_id} (pid {h.pid})"
                for h in entry.users if h.job_id in ids]  # fmt: skip
    if os.geteuid() == 0:
        out += [
            f"checkpoint image {p.name}"
            for j in job_ids
            for p in images_of_job(cfg.paths.images, j) + temp_dirs(cfg.paths.images, j)
        ]
    return out


def kept_instances(cfg: Config, job_ids: list[str]) -> list[str]:
    """The jobs whose instance spswapd still keeps (frozen processes holding memory): a
    job cancelled while queued runs no epilog, so spswapd ends its kept instance when its
    sweep finds the job gone (SPSWAP_SWEEP_INTERVAL_S); until then it is left over."""
    out = []
    client = Client(cfg, timeout_s=10.0)
    for job_id in job_ids:
        try:
            status = client.call("checkpoint.status", job_id=job_id)
        except SpswapError:
            continue  # not registered here (any more), or not the caller's: nothing kept
        if status.get("kept"):
            out.append(f"the kept instance of job {job_id} (pid {status.get('pid')})")
    return out


def job_gone(slurm: JobControl, job_id: str) -> bool | None:
    """Whether Slurm is done with the job (ended, or no longer known); None when Slurm
    did not answer. Pending and requeued-held jobs are not gone."""
    try:
        info = slurm.job(job_id)
    except SpswapError:
        return None
    return info is None or job_fate(info.state, None) == "gone"


def slurm_preflight(partition: str, slurm: JobControl | None = None) -> None:
    """Slurm's part of the preflight: its commands, its controller, the partition; the
    command runs it before it writes any model (a wrong --partition cost seconds of
    writing models first, and left them)."""
    slurm = slurm or JobControl()
    if not slurm.available():
        raise ConfigError("bench turns needs Slurm's commands (sbatch, scontrol, squeue, "
                          "scancel) on PATH: run it on a login or compute node of the "
                          "cluster")  # fmt: skip
    if not controller_up():
        raise ConfigError(
            "Slurm's controller does not answer `scontrol ping`: start "
            "slurmctld (systemctl start slurmctld) or check slurm.conf"
        )
    parts = slurm.partitions()
    if partition not in parts:
        raise ConfigError(f"no partition {partition!r} (sinfo lists "
                          f"{', '.join(parts) or 'none'}); pass --partition NAME")  # fmt: skip


def run_turns(opts: TurnsOptions, cfg: Config, *, log: Callable[[str], None] = print
              ) -> TurnsSummary:  # fmt: skip
    """The whole bench: preflight, submit held, cold turns, R rounds, cancel, check.
    The caller runs :func:`slurm_preflight` first (`spswap bench turns` does, before it
    writes any model; the walk saw Slurm asked twice)."""
    run = TurnsRun(opts, cfg, log=log)
    run.make_jobs()
    run.preflight()
    plan = plan_turns(len(run.jobs), opts.rounds)
    results: list[TurnResult] = []
    first_round_s: float | None = None
    try:
        run.submit()
        for turn in plan:
            if turn.kind is TurnKind.RESTORE and first_round_s is None:
                first_round_s = time.time()
            results.append(run.run_turn(turn))
            if turn.index == 0:
                run.check_daemon()
    finally:
        left = run.cleanup()
    wall_s = run.last_answer_s - first_round_s if first_round_s and run.last_answer_s else 0.0
    return summarize([j.name for j in run.jobs], results, wall_s=max(0.0, wall_s),
                     settings=run.settings(), leftovers=left,
                     job_ids={j.name: j.job_id for j in run.jobs})  # fmt: skip
