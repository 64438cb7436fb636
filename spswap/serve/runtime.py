"""``spswap serve``: one model server inside a Slurm job that survives preemption.

Life of a run:
  1. reserve a slot on the job's GPU (FIFO behind whoever holds it);
  2. make sure the model is in the pool (first time: read from disk once), start the
     engine from the pool;
  3. answer requests from the spool (and the job-local socket) until idle or told to stop;
  4. on the preemption signal (USR1) or SIGTERM: stop admitting, leave unanswered requests
     in the spool (that is the saved state), suspend the engine through the
     :class:`Suspender` (today: sleep; with CRIU: sleep + CUDA checkpoint + dump),
     release the slot, ask Slurm to requeue when the signal was USR1, and exit.
A run with restart count > 0 finds the saved requests in the spool and answers them first.

Signal handlers only set a flag (no work, no forking in a handler); the loop notices it
between requests.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from spswap.config import Config
from spswap.errors import RequestAborted, RequestRejected, SpswapError, StopRequested
from spswap.instance.registry import InstanceRecord, InstanceRegistry
from spswap.serve.checkpointer import not_coming_back, restored_how
from spswap.serve.run_log import RunPath, note_run, process_started_s
from spswap.serve.slot_hold import RunSlot, StopSignals
from spswap.serve.spool import Request, Spool


class Suspender(Protocol):
    """How a stopping server puts its engine away; the CRIU checkpoint plugs in here."""

    name: str

    def suspend(self, engine: Any) -> dict[str, Any]:
        """Move the engine out of the GPU; return what was done (for the event log)."""
        ...


class SleepSuspender:
    """Until a CRIU image can be taken: sleep the engine (weights out of device memory);
    the request spool is the rest of the saved state."""

    name = "sleep"

    def suspend(self, engine: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        engine.sleep()
        return {"suspender": self.name, "seconds": time.perf_counter() - t0}


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


@dataclass
class ServeResult:
    answered: int = 0
    resumed: int = 0  # requests found in the spool at start (saved by an earlier run)
    stopped_by: str | None = None  # signal name when preempted
    pending_left: int = 0
    refused: int = 0  # requests answered with an error (bad input), not with tokens
    events: list[dict[str, Any]] = field(default_factory=list)


EngineFactory = Callable[[ServeOptions], Any]


class Server(StopSignals):
    """One serving run. Construct, then :meth:`run`; the pieces are injected so tests
    can drive each step (signal handlers are methods, not closures)."""

    def __init__(
        self,
        cfg: Config,
        opts: ServeOptions,
        *,
        engine_factory: EngineFactory,
        job_id: str | None = None,
        restart_count: int = 0,
        suspender: Suspender | None = None,
        requeue: Callable[[str], None] | None = None,
        checkpointer: Any = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.cfg = cfg
        self.opts = opts
        self.engine_factory = engine_factory
        self.job_id = job_id
        self.restart_count = restart_count
        self.suspender = suspender or SleepSuspender()
        self.requeue = requeue
        self.log = log
        self.spool = Spool(opts.state_dir)
        self.instance_id = f"{job_id or 'local'}-{os.getpid()}"
        self.registry = InstanceRegistry(cfg.paths.run / "instances")
        self.checkpointer = checkpointer
        self.reason: str | None = None  # why this run started cold, when it did
        super().__init__(RunSlot(cfg, model=opts.model.name, units=opts.units,
                                 gpus=opts.slot_gpus, job_id=job_id,
                                 timeout_s=opts.slot_timeout_s))  # fmt: skip
        self.front: Any = None
        self.started_s = process_started_s()  # the run's start, for its runs.jsonl line

    # -- the run ---------------------------------------------------------------
    def run(self) -> ServeResult:
        """Serve until idle (with ``exit_when_idle``) or told to stop; see the module doc."""
        result = ServeResult()
        self.spool.create()
        if self.opts.requests_file is not None:
            self._enqueue_file(self.opts.requests_file)
        quarantined = self.spool.quarantine_crashed()
        if quarantined:
            self.log(f"spswap serve: request {quarantined} was being answered when an "
                     "earlier run ended; answered with an error, not asked again")  # fmt: skip
        result.resumed = self._pending() if self.restart_count else 0
        from spswap.access import PoolAccess
        from spswap.serve.front import Front

        self.front = Front(self.spool, self.opts.socket_path) if self.opts.socket_path else None

        pool = PoolAccess(self.cfg, job_id=self.job_id)  # through spswapd unless root
        manifest = pool.import_checkpoint(self.opts.model)
        try:
            self.slot.reserve(self.stop_signal)
        except StopRequested as e:  # nothing started; the spool keeps every request
            result.stopped_by = self.stop_signal
            self.log(f"spswap serve: {e}; the requests wait for the next run")
            if self.stop_signal == "SIGUSR1" and self.requeue and self.job_id:
                self.requeue(self.job_id)
            return self._finish(result)
        engine = None
        try:
            if self.restart_count and self.checkpointer is not None and self.job_id:
                if self._restore_and_proxy(manifest.digest, result):
                    return self._finish(result)
            engine = self.engine_factory(self.opts)
            t0 = time.perf_counter()
            engine.load_from_pool(pool, manifest.digest)
            if self.front is not None:
                self.front.open()
            self._record("up")
            self._note_run(RunPath.COLD if manifest.created >= self.started_s else RunPath.POOL)
            self.log(f"spswap serve: {manifest.name} up from the pool in "
                     f"{time.perf_counter() - t0:.2f} s; restart count {self.restart_count}, "
                     f"{result.resumed} saved request(s) to resume")  # fmt: skip
            self._serve_until_done(engine, manifest.digest, result)
        finally:
            self.slot.release()
            if self.front is not None:
                self.front.close("the server has ended")
            if engine is not None and not self.stop_event.is_set():
                engine.close()
                self.registry.remove(self.instance_id)
        return self._finish(result)

    def _finish(self, result: ServeResult) -> ServeResult:
        result.pending_left = self._pending()
        return result

    def _pending(self) -> int:
        return sum(1 for _ in self.spool.pending())

    def _serve_until_done(self, engine: Any, digest: str, result: ServeResult) -> None:
        """Serve; on a stop, suspend and (with a checkpointer) park until restored."""
        while True:
            self._serve_loop(engine, result)
            if not self.stop_event.is_set():
                return  # idle and asked to exit when idle
            result.stopped_by = self.stop_signal
            if self.front is not None:  # stop admitting; a dump cannot keep connections
                self.front.close(f"the server is stopping ({self.stop_signal}) before it "
                                 "answered; your request is saved and answered by the "
                                 "job's next run")  # fmt: skip
            result.events.append(self.suspender.suspend(engine))
            self._record("sleep")
            self.slot.release()
            requeue = result.stopped_by == "SIGUSR1" and self.job_id is not None
            gone = not_coming_back(self.job_id, self.stop_signal, self.restart_count,
                                   log=self.log) \
                if self.checkpointer and self.job_id else None  # fmt: skip
            outcome = self._park(digest, requeue) if self.checkpointer and not gone else None
            if outcome is None or outcome.state != "restored":
                if outcome is not None:
                    result.events.append({"checkpoint": "failed", "reason": outcome.reason})
                    self.log(f"spswap serve: no checkpoint image ({outcome.reason}); the next "
                             "run starts from the pool")  # fmt: skip
                if requeue and self.requeue and self.job_id:
                    # scancel --signal=USR1 --batch does not requeue by itself; preemption
                    # does, and a second requeue of a job already pending is harmless.
                    self.requeue(self.job_id)
                return
            # Restored by a later run of the job: its proxy holds the slot.
            self.restart_count = outcome.restart_count
            self.clear_stop()
            result.stopped_by = None
            t0 = time.perf_counter()
            engine.wake()
            if self.front is not None:
                self.front.open()
            self._record("up")
            result.events.append({"restored": True, "restart_count": self.restart_count,
                                  "timings_s": outcome.timings_s,
                                  "wake_s": time.perf_counter() - t0})  # fmt: skip
            self.log(f"spswap serve: restored {restored_how(outcome.kept)} into run "
                     f"{self.restart_count}; weights back in {time.perf_counter() - t0:.3f} s")

    def _park(self, digest: str, requeue: bool) -> Any:
        """Ask the daemon to dump this process; returns when restored or refused."""
        from spswap.serve.checkpointer import ParkOutcome

        assert self.checkpointer is not None and self.job_id is not None
        self._record("checkpoint")
        try:
            return self.checkpointer.park(self.job_id, self._identity(digest), requeue=requeue)
        except SpswapError as e:
            return ParkOutcome("failed", reason=str(e))

    def _restore_and_proxy(self, digest: str, result: ServeResult) -> bool:
        """In a requeued run: restore the job's instance and stand in for it until it exits
        (forwarding signals); False when there is nothing to restore (cold start)."""
        assert self.checkpointer is not None and self.job_id is not None
        try:
            info = self.checkpointer.restore(self.job_id, self._identity(digest),
                                             self.restart_count)  # fmt: skip
        except SpswapError as e:
            self.reason = f"cold start: {e}"
            self.log(f"spswap serve: {self.reason}")
            return False
        pid = int(info["pid"])
        how = restored_how(bool(info.get("kept")))
        self.log(f"spswap serve: job {self.job_id} restored {how} as pid {pid} "
                 f"({info.get('timings_s')}); standing in for it")  # fmt: skip
        result.events.append({"restored_pid": pid, "timings_s": info.get("timings_s")})
        self._note_run(RunPath.KEPT if info.get("kept") else RunPath.IMAGE)
        from spswap.serve.checkpointer import stand_in_for

        forwarded = stand_in_for(pid, lambda: self.stop_signal)
        result.stopped_by = forwarded
        if forwarded is None and (self._pending() or not self.opts.exit_when_idle):
            # It ended on its own before its work was done (a crash, a kill): serve on
            # from the pool in this run rather than leave the job idle.
            self.reason = (f"cold start: the restored instance (pid {pid}) ended with "
                           f"{self._pending()} request(s) unanswered")  # fmt: skip
            self.log(f"spswap serve: {self.reason}")
            return False
        return True

    def _identity(self, digest: str) -> dict[str, str]:
        """What this instance names of its identity at a dump and expects at a restore:
        the same fields both times, or the image is refused."""
        from spswap.checkpoint.images import config_hash, process_identity

        cfg_hash = config_hash({"engine": self.opts.engine, "device": self.opts.device,
                                "model": str(self.opts.model), "units": self.opts.units})
        return process_identity(engine=self.opts.engine, engine_version="",
                                model_digest=digest, config_hash=cfg_hash)  # fmt: skip

    def _drained(self) -> bool:
        """Stopping, and the request being answered had its ``drain_s``."""
        return self.stop_event.is_set() and \
            time.monotonic() - self.stopped_at > self.opts.drain_s  # fmt: skip

    def _serve_loop(self, engine: Any, result: ServeResult) -> None:
        while not self.stop_event.is_set():
            pending = list(self.spool.pending())
            for req in pending:
                if self.stop_event.is_set():
                    return
                self.spool.running(req, self.restart_count)
                try:
                    out = engine.generate([req.prompt_ids], req.max_new_tokens,
                                          abort=self._drained)[0]  # fmt: skip
                except RequestAborted:  # the stop's drain ran out: saved for the next run
                    self.log(f"spswap serve: request {req.id} stopped unfinished after "
                             f"{self.opts.drain_s:g} s of drain; saved for the next run")
                    return
                except Exception as e:  # noqa: BLE001 - no request may end the server
                    why = str(e) if isinstance(e, RequestRejected) else \
                        f"the engine failed on this request ({type(e).__name__}: {e})"  # fmt: skip
                    self.spool.fail(req, why, job_id=self.job_id,
                                    restart_count=self.restart_count)  # fmt: skip
                    self.log(f"spswap serve: request {req.id} refused: {why}")
                    result.refused += 1
                    continue
                finally:
                    self.spool.not_running()
                self.spool.complete(req, out, job_id=self.job_id,
                                    restart_count=self.restart_count)  # fmt: skip
                result.answered += 1
            if not pending and self.opts.exit_when_idle:
                return
            self.stop_event.wait(self.opts.poll_interval_s)

    def _enqueue_file(self, path: Path) -> int:
        import json

        added = 0
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpswapError(f"{path}:{n}: not JSON ({e}); one request per line") from None
            added += self.spool.submit(Request.from_json(data))
        return added

    def _note_run(self, path: RunPath) -> None:
        note_run(self.opts.state_dir, self.restart_count, path, reason=self.reason,
                 log=self.log)  # fmt: skip

    def _record(self, state: str) -> None:
        self.registry.put_best_effort(InstanceRecord(
            id=self.instance_id, model=self.opts.model.name, state=state, pid=os.getpid(),
            uid=os.getuid(), job_id=self.job_id, device=self.opts.device,
            engine=self.opts.engine, reason=self.reason,
        ), self.log)  # fmt: skip
