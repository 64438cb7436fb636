"""``spswap serve`` with the reference engine: the engine in this process, requests from
the job's spool (and its job-local socket, :mod:`spswap.serve.front`).

The run itself (slot, restore or start, stop, park, release) is
:class:`spswap.serve.lifecycle.ServeRun`'s; this module is its :class:`Backend` for the
reference engine:
  - prepare: the spool (requests from ``--requests`` enqueued once; a request that an
    earlier run was answering when it crashed answered with an error, not asked again),
    the model into the pool;
  - start: a fresh engine filled from the pool, the socket front open;
  - serve: answer the spool's requests until idle (with ``exit_when_idle``) or stopped;
  - drain: the socket front closes (each waiting client told its request is saved), and
    the request being answered gets ``drain_s`` before it is saved for the next run;
  - sleep / wake: the engine's weights out of memory for a dump, back from the pool.
Whatever is unanswered at a stop stays in the spool: a requeued run (restart count > 0)
finds the saved requests and answers them first.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spswap.access import PoolAccess
from spswap.checkpoint.images import config_hash, process_identity
from spswap.config import Config
from spswap.engines.host_heap import release_free_heap
from spswap.errors import RequestAborted, RequestIdTaken, RequestRejected, SpswapError
from spswap.pool.manifest import Manifest
from spswap.serve import restore_check
from spswap.serve.backend import Log, ServeResult
from spswap.serve.checkpointer import DaemonCheckpointer
from spswap.serve.front import Front
from spswap.serve.lifecycle import ServeRun
from spswap.serve.run_log import RunPath
from spswap.serve.slot_hold import RunSlot, StopSignals
from spswap.serve.spool import Request, Spool


@dataclass
class ServeOptions:
    """What ``spswap serve`` was asked to do."""

    model: Path  # checkpoint directory (config.json + safetensors)
    state_dir: Path  # spool lives here; must survive the requeue
    engine: str = "reference"
    device: str = "cpu"
    units: int = 4
    slot_timeout_s: float = 600.0
    requests_file: Path | None = None  # JSON lines to enqueue once (batch jobs)
    exit_when_idle: bool = False
    poll_interval_s: float = 0.05
    slot_gpus: tuple[int, ...] = ()  # GPUs the job was given (slot table indexes)
    socket_path: Path | None = None  # the front door (Unix socket, mode 0600); None: spool only
    drain_s: float = 5.0  # at a stop: how long the request being answered may still run


EngineFactory = Callable[[ServeOptions], Any]


class ReferenceBackend:
    """The reference engine's side of a run (see the module doc)."""

    probe_at_start = True  # one model: its check's answer taken when it is first up
    checks_several = False

    def __init__(self, cfg: Config, opts: ServeOptions, *, engine_factory: EngineFactory,
                 job_id: str | None, stop: StopSignals, log: Log) -> None:  # fmt: skip
        self.cfg, self.opts, self.engine_factory = cfg, opts, engine_factory
        self.job_id, self.log = job_id, log
        self.stop = stop  # the run's stop request: its event, and when it was asked
        self.engine, self.device, self.state_dir = opts.engine, opts.device, opts.state_dir
        self.spool = Spool(opts.state_dir)
        self.front = Front(self.spool, opts.socket_path) if opts.socket_path else None
        self.pool = PoolAccess(cfg, job_id=job_id)  # through spswapd unless root
        self.manifest: Manifest | None = None
        self.model: Any = None  # the engine, once started
        self.restart_count = 0
        self.from_files = False  # the pool entry is damaged: the model's own files serve

    def prepare(self, result: ServeResult) -> None:
        self.restart_count = result.restart_count
        self.spool.create()
        if self.opts.requests_file is not None:
            added, lines, answered = self._enqueue_file(self.opts.requests_file)
            if added < lines:  # ids asked before: each is asked once (idempotent)
                self.log(requests_file_text(
                    self.opts.requests_file, lines=lines, added=added, answered=answered,
                    outbox=self.spool.outbox))  # fmt: skip
        quarantined = self.spool.quarantine_crashed()
        if quarantined:
            self.log(f"spswap serve: request {quarantined} was being answered when an "
                     "earlier run ended; answered with an error, not asked again")  # fmt: skip
        result.resumed = self._pending() if self.restart_count else 0
        self.manifest = self.pool.import_checkpoint(
            self.opts.model, on_damaged=lambda problem: self.log(f"spswap serve: {problem}")
        )
        result.digest = self.manifest.digest

    def checkpoint_identity(self) -> dict[str, str]:
        assert self.manifest is not None
        cfg_hash = config_hash(
            {
                "engine": self.opts.engine,
                "device": self.opts.device,
                "model": str(self.opts.model),
                "units": self.opts.units,
            }
        )
        return process_identity(engine=self.opts.engine, engine_version="",
                                model_digest=self.manifest.digest,
                                config_hash=cfg_hash)  # fmt: skip

    def start(self, result: ServeResult) -> RunPath:
        assert self.manifest is not None
        self.model = self.engine_factory(self.opts)
        t0 = time.perf_counter()
        if self.from_files:  # (check_pool found the entry damaged)
            self.model.load_from_checkpoint(self.opts.model)
            self._open_front()
            self.log(f"spswap serve: {self.manifest.name} up from its files in "
                     f"{time.perf_counter() - t0:.2f} s, not from its damaged pool entry; "
                     "a stop of this run is not checkpointed")  # fmt: skip
            return RunPath.COLD
        report = self.model.load_from_pool(self.pool, self.manifest.digest)
        result.copy = report.to_json()
        self._open_front()
        # imported by this run (its process started before the entry was made): cold
        path = RunPath.COLD if self.manifest.created >= result.started_s else RunPath.POOL
        how = ("(cold: read from its files into the pool by this run, then loaded from it)"
               if path is RunPath.COLD else "from the pool")  # fmt: skip
        # the engine's start alone: the run's whole start is in runs.jsonl (its marks)
        self.log(f"spswap serve: {self.manifest.name} up {how}; engine started in "
                 f"{time.perf_counter() - t0:.2f} s (weights {report.size_bytes / 1e6:.1f} MB "
                 f"at {report.gb_per_s:.1f} GB/s); restart count {result.restart_count}, "
                 f"{result.resumed} saved request(s) to resume")  # fmt: skip
        return path

    def serve(self, result: ServeResult) -> None:
        self.restart_count = result.restart_count
        stop = self.stop.stop_event
        while not stop.is_set():
            pending = list(self.spool.pending())
            for req in pending:
                if stop.is_set() or not self._answer(req, result):
                    return
            if not pending and self.opts.exit_when_idle:
                return
            stop.wait(self.opts.poll_interval_s)

    def _answer(self, req: Request, result: ServeResult) -> bool:
        """Answer one request (tokens or, for a bad one, an error); False when the stop's
        drain ran out under it (it stays in the spool for the next run)."""
        self.spool.running(req, self.restart_count)
        try:
            out = self.model.generate([req.prompt_ids], req.max_new_tokens,
                                      abort=self._drained)[0]  # fmt: skip
        except RequestAborted:
            self.log(
                f"spswap serve: request {req.id} stopped unfinished after "
                f"{self.opts.drain_s:g} s of drain; kept in the job's inbox for its next run "
                "(if Slurm runs the job again)"
            )
            return False
        except Exception as e:  # noqa: BLE001 - no request may end the server
            why = str(e) if isinstance(e, RequestRejected) else \
                f"the engine failed on this request ({type(e).__name__}: {e})"  # fmt: skip
            self.spool.fail(req, why, job_id=self.job_id, restart_count=self.restart_count)
            self.log(f"spswap serve: request {req.id} refused: {why}")
            result.refused += 1
            return True
        finally:
            self.spool.not_running()
        self.spool.complete(req, out, job_id=self.job_id, restart_count=self.restart_count)
        result.answered += 1
        return True

    def _drained(self) -> bool:
        """Stopping, and the request being answered had its ``drain_s``."""
        return self.stop.stop_event.is_set() and \
            time.monotonic() - self.stop.stopped_at > self.opts.drain_s  # fmt: skip

    def drain(self, result: ServeResult) -> None:
        # the request being answered had its drain in serve(); the front takes no more
        if self.front is not None:
            self.front.close(f"the server is stopping ({self.stop.stop_signal}) before it "
                             "answered; your request is saved and answered by the job's "
                             "next run")  # fmt: skip

    def _open_front(self) -> None:
        """Take requests on the socket, and say so once it takes them (a script that reads
        the log line and connects at once is never refused)."""
        if self.front is not None:
            self.front.open()
            self.log(f"spswap serve: requests on {self.front.path}")

    def sleep(self) -> None:
        self.model.sleep()
        release_free_heap()  # the image holds only live host memory

    def wake(self, result: ServeResult) -> dict[str, Any]:
        self.model.wake()
        self._open_front()
        # a new run of the same process: its counts from here on are this run's
        result.resumed, result.answered_before = self._pending(), result.answered
        return {"saved_requests": result.resumed}

    def probe(self, like: restore_check.CheckAnswer | None = None,
              ) -> restore_check.CheckAnswer | None:  # fmt: skip
        if self.model is None:
            return None
        prompt = list(restore_check.PROBE_PROMPT)
        out: list[int] = self.model.generate([prompt], restore_check.PROBE_TOKENS)[0]
        return restore_check.CheckAnswer(tuple(out))

    def check_pool(self) -> str | None:
        if self.manifest is None:
            return None
        problem = self.pool.check(self.manifest.digest)
        if problem is None:
            return None
        if not self.pool.has(self.manifest.digest):  # removed: in the pool again, whole
            self.manifest = self.pool.import_checkpoint(self.opts.model)
            return f"{problem}; this run imported it again from {self.opts.model}"
        self.from_files = True
        return f"{problem}; this run reads the model from its files ({self.opts.model})"

    def left_undone(self) -> str | None:
        n = self._pending()
        if n or not self.opts.exit_when_idle:  # a server with no exit when idle never is done
            return f"{n} request(s) unanswered"
        return None

    def close(self, result: ServeResult, *, served: bool) -> None:
        if self.front is not None:
            self.front.close("the server has ended")
        model, self.model = self.model, None
        if model is not None:
            model.close()
        result.pending_left = self._pending()

    def _pending(self) -> int:
        return sum(1 for _ in self.spool.pending())

    def _enqueue_file(self, path: Path) -> tuple[int, int, int]:
        """(requests newly accepted, requests in the file, of them answered before); a
        line refused (its id asked before with another prompt) is logged, not counted."""
        added = lines = answered = 0
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            lines += 1
            try:
                data = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpswapError(f"{path}:{n}: not JSON ({e}); one request per line") from None
            try:
                req = Request.from_json(data)
                was_answered = self.spool.answer(req.id) is not None
                added += self.spool.submit(req)
                answered += was_answered
            except RequestIdTaken as e:  # the rest of the file still counts
                self.log(f"spswap serve: {path}:{n}: {e}; that line is not asked")
                lines -= 1
        return added, lines, answered


def requests_file_text(path: Path, *, lines: int, added: int, answered: int,
                       outbox: Path) -> str:  # fmt: skip
    """The job log's line when a requests file names requests asked before (a requeued
    batch job reads its file again): how many were answered, how many an earlier run saved
    for this one, how many are new; each is asked once.

    >>> requests_file_text(Path("r"), lines=30, added=0, answered=6, outbox=Path("o"))[41:]
    '6 were answered before (answers in o), 24 were saved by an earlier run for this one, 0 are new'
    """
    saved = lines - added - answered
    return (f"spswap serve: of the {lines} request(s) in {path}, {answered} were answered "
            f"before (answers in {outbox}), {saved} were saved by an earlier run for this one, "
            f"{added} are new")  # fmt: skip


def reference_run(
    cfg: Config, opts: ServeOptions, *, engine_factory: EngineFactory,
    job_id: str | None = None, restart_count: int = 0,
    requeue: Callable[[str], None] | None = None,
    checkpointer: DaemonCheckpointer | None = None, log: Log = print,
) -> ServeRun[ReferenceBackend]:  # fmt: skip
    """A run of the reference engine; then ``install_signal_handlers()`` and ``run()``."""
    stop = StopSignals(RunSlot(cfg, model=opts.model.name, units=opts.units,
                               gpus=opts.slot_gpus, job_id=job_id,
                               timeout_s=opts.slot_timeout_s))  # fmt: skip
    backend = ReferenceBackend(cfg, opts, engine_factory=engine_factory, job_id=job_id,
                               stop=stop, log=log)  # fmt: skip
    return ServeRun(cfg, backend, stop, model_name=opts.model.name, job_id=job_id,
                    restart_count=restart_count, requeue=requeue, checkpointer=checkpointer,
                    log=log)  # fmt: skip
