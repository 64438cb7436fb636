"""One run of ``spswap serve``, whatever the engine: the lifecycle owns the run, a
:class:`Backend` owns the engine and the ways in (spool, sockets, HTTP front).

Life of a run (the order matters: each step gives back what the one before took):
  1. :meth:`Backend.prepare`: what can fail with a clear error before a slot is taken;
  2. reserve a slot on the job's GPU (FIFO behind whoever holds it; a stop ends the wait);
  3. in a requeued run with a checkpointer: ask spswapd to restore the job's instance and
     stand in for it (forwarding stop signals) until it exits. An instance that ends on its
     own while it had work left (a crash, a kill) is replaced: what it left running is
     ended and this run starts cold, saying why in the job's log and ``runs.jsonl``;
  4. else start the engine (:meth:`Backend.start`: from the pool, or cold from the model's
     files) and serve until stopped (:meth:`Backend.serve`);
  5. at a stop (USR1 = preemption, SIGTERM, SIGINT): stop admitting and drain; when the job
     comes back (:func:`not_coming_back` says a dump would not be wasted) and spswapd can
     checkpoint: sleep the engine, release the slot and park. A later run that restores
     the process wakes it here (:meth:`Backend.wake`) and serving goes on (back to 4's loop);
  6. at the end: the backend gives back its engine, the instance record goes, the slot is
     released, and a preempted run asks Slurm to requeue it (last: also after an error).

Signal handlers only set a flag (:class:`StopSignals`); the loop does the work.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, Generic, TypeVar

from spswap.config import Config
from spswap.daemon.statuses import CheckpointState
from spswap.errors import SpswapError, StopRequested
from spswap.instance.registry import InstanceRecord, InstanceRegistry
from spswap.serve import restore_check
from spswap.serve.backend import Backend, Log, ServeResult
from spswap.serve.checkpointer import (
    DaemonCheckpointer,
    ParkOutcome,
    end_left_behind,
    not_coming_back,
    process_tree,
    requeueable,
    restored_how,
    stand_in_for,
)
from spswap.serve.restore_check import CheckAnswer
from spswap.serve.run_log import RunPath, note_run, process_started_s
from spswap.serve.run_watch import left_job
from spswap.serve.slot_hold import RunSlot, StopSignals

B = TypeVar("B", bound=Backend)


def run_steps(steps: list[tuple[str, Callable[[], Any]]], log: Log) -> None:
    """Run each step on its own: one failing (spswapd gone, a full disk) is logged and
    must not skip the others, nor hide the run's own error."""
    for what, step in steps:
        try:
            step()
        except Exception as e:  # noqa: BLE001 - logged; the other steps still run
            log(f"spswap serve: could not {what} ({e})")


class ServeRun(Generic[B]):
    """One serving run of ``backend``; construct, then :meth:`run` (see the module doc).
    ``stop`` is the run's stop request (with its GPU slot), shared with the backend,
    whose serving loop waits on it. Tests drive each step: the signal handler is a
    method, the pieces are injected."""

    def __init__(
        self, cfg: Config, backend: B, stop: StopSignals, *, model_name: str,
        job_id: str | None = None, restart_count: int = 0,
        requeue: Callable[[str], None] | None = None,
        checkpointer: DaemonCheckpointer | None = None, log: Log = print,
        record_state: Callable[[str], None] | None = None,
    ) -> None:  # fmt: skip
        self.stop = stop
        self.slot: RunSlot = stop.slot
        self.cfg = cfg
        self.backend = backend
        self.model_name = model_name
        self.job_id = job_id
        self.restart_count = restart_count
        self.requeue = requeue
        self.checkpointer = checkpointer  # spswapd: a stop dumps, a requeued run restores
        self.log = log
        # None: the run's one row in `spswap status`; else the backend keeps its own rows
        self.record_state = record_state
        self.registry = InstanceRegistry(cfg.paths.instances)
        self.instance_id = f"{job_id or 'local'}-{os.getpid()}"
        self.reason: str | None = None  # why this run started cold, when it did
        # the run's start, for its runs.jsonl line
        forked_s = checkpointer.run_started_s if checkpointer is not None else None
        self.started_s = forked_s if forked_s is not None else process_started_s()
        self.marks_s: dict[str, float] = {}  # step -> epoch seconds, for runs.jsonl
        self.expected: CheckAnswer | None = None  # the check prompt's answer, from the start
        # Slurm's Requeue flag, as the job's first run wrote it (None: unknown)
        self.requeue_flag = requeueable(backend.state_dir, job_id)
        self.probe_s: float | None = None  # how long that answer took

    def handle_signal(self, signum: int, frame: FrameType | None = None) -> None:
        """A stop signal (see :meth:`StopSignals.handle_signal`)."""
        self.stop.handle_signal(signum, frame)

    def install_signal_handlers(self) -> None:
        """Preemption (USR1), SIGTERM and SIGINT ask the run to stop."""
        self.stop.install_signal_handlers()

    def run(self) -> ServeResult:
        """Serve until the work is done or the run is told to stop; see the module doc."""
        result = ServeResult(restart_count=self.restart_count, started_s=self.started_s)
        proxied = False
        try:
            self.marks_s["run"] = time.time()
            self.backend.prepare(result)
            self.marks_s["prepared"] = time.time()
            self.slot.reserve(self.stop.stop_signal)
            self.marks_s["reserved"] = time.time()
            if self.restart_count and self.checkpointer is not None and self.job_id:
                proxied = self._restore_and_proxy(result)
                if proxied:
                    return result
            t0 = time.perf_counter()
            result.path = self.backend.start(result)
            result.start_s = time.perf_counter() - t0
            self._record("up")
            if self.backend.probe_at_start and self.checkpointer is not None and self.job_id:
                self.expected = self._probe("at its start")
            self._note_run(result.path, copy=result.copy)
            while True:
                self.backend.serve(result)
                if not self.stop.stop_event.is_set():
                    break  # the work is done (exit when idle)
                result.stopped_by = self.stop.stop_signal
                self.backend.drain(result)
                if not self._park(result):
                    break
        except StopRequested as e:  # stopped before anything served: a clean end
            result.stopped_by = self.stop.stop_signal
            self.log(f"spswap serve: {e}; nothing was started")
        finally:
            self._end(result, proxied)
        return result

    # -- the steps ----------------------------------------------------------------------
    def _park(self, result: ServeResult) -> bool:
        """Sleep and have spswapd dump this process (its whole tree), when the job comes
        back. True when a later run restored it (serving goes on here); False when there
        was no dump (no spswapd, the job ends for good, the dump failed)."""
        if self.checkpointer is None or not self.job_id:
            return False
        if not_coming_back(
            self.job_id,
            self.stop.stop_signal,
            self.restart_count,
            requeue_flag=self.requeue_flag,
            log=self.log,
        ):
            return False
        expected = (self.expected if self.backend.probe_at_start
                    else self._probe("before its checkpoint"))  # fmt: skip
        try:
            self.backend.sleep()
        except (SpswapError, OSError) as e:  # the engine is given back by close()
            result.events.append({"checkpoint": "failed", "reason": f"sleep failed: {e}"})
            self.log(f"spswap serve: the engine did not sleep ({e}); not checkpointed")
            return False
        self._release_slot("; the checkpoint goes on")  # it matters more than the slot
        self._record("checkpoint")
        # the last line this run writes: spswapd parks this process out of the job now
        self.log(f"spswap serve: stopped by {self.stop.stop_signal}: asleep, handed to spswapd "
                 "for the job's next run (kept alive or dumped to an image: `spswap events` "
                 "says which)")  # fmt: skip
        requeue = self.stop.stop_signal == "SIGUSR1"  # the daemon's, once the image is whole
        try:
            outcome = self.checkpointer.park(self.job_id, self.backend.checkpoint_identity(),
                                             requeue=requeue)  # fmt: skip
        except (SpswapError, OSError) as e:
            outcome = ParkOutcome(CheckpointState.FAILED, reason=str(e))
        if outcome.state is not CheckpointState.RESTORED:
            result.events.append({"checkpoint": "failed", "reason": outcome.reason})
            self.log(f"spswap serve: no checkpoint image ({outcome.reason}); the next run "
                     "starts from the pool")  # fmt: skip
            return False
        # Restored into a later run of the job: its proxy holds the slot now.
        self.restart_count = result.restart_count = outcome.restart_count
        self.stop.clear_stop()
        result.stopped_by = None
        t0 = time.perf_counter()
        woken = self.backend.wake(result)
        wake_s = time.perf_counter() - t0
        failed = self._check_restored(expected)
        check_s = time.perf_counter() - t0 - wake_s
        if failed is not None:
            result.events.append({"restored": True, "restart_count": self.restart_count,
                                  "probe": "mismatch", "reason": failed})  # fmt: skip
            self.log(f"spswap serve: {failed}")
            restore_check.note_refused(self.backend.state_dir, self.restart_count, failed)
            return False  # ends here; the job's run (its stand-in) starts cold
        self._record("up")
        probe_s = self.probe_s if expected is not None else None
        result.events.append({"restored": True, "restart_count": self.restart_count,
                              "timings_s": outcome.timings_s, "wake_s": wake_s,
                              "check_s": check_s, "probed": expected is not None,
                              "probe_first_s": probe_s, **woken})  # fmt: skip
        self.log(restore_check.restored_text(restored_how(outcome.kept), self.restart_count,
                                             wake_s=wake_s, check_s=check_s,
                                             check_first_s=probe_s,
                                             saved=woken.get("saved_requests"),
                                             several=self.backend.checks_several))  # fmt: skip
        return True

    def _restore_and_proxy(self, result: ServeResult) -> bool:
        """In a requeued run: have spswapd restore the job's instance and stand in for it
        until it exits (forwarding signals). False: this run starts cold (nothing to
        restore, or the restored instance ended on its own with work left)."""
        assert self.checkpointer is not None and self.job_id is not None
        try:
            identity = self.backend.checkpoint_identity()
            self.marks_s["restore_asked"] = time.time()  # (from "reserved": the identity's)
            info = self.checkpointer.restore(self.job_id, identity, self.restart_count)
        except SpswapError as e:
            self._cold(result, "starts anew: " + str(e).removesuffix(": cold start"))
            return False
        self.marks_s["restored"] = time.time()
        pid, kept = int(info["pid"]), bool(info.get("kept"))
        timings = restore_check.timings_text(info.get("timings_s"))
        self.log(f"spswap serve: job {self.job_id} restored {restored_how(kept)} as pid {pid} "
                 f"({timings}); this run stands by while it serves, passing on its "
                 "signals")  # fmt: skip
        result.restored_pid = pid
        result.events.append({"restored_pid": pid, "timings_s": info.get("timings_s")})
        self._note_run(RunPath.KEPT if kept else RunPath.IMAGE)
        # CRIU restores the whole tree at once (a kept tree is thawed whole): its
        # processes now are what a crash of the instance could leave behind
        tree = process_tree(pid)
        job_id, checkpointer = self.job_id, self.checkpointer
        result.stopped_by = stand_in_for(pid, lambda: self.stop.stop_signal, left_job=lambda: (
            left_job(pid, job_id, checkpointer.status)))  # fmt: skip
        left = self.backend.left_undone() if result.stopped_by is None else None
        if left is None:  # (the instance logged where it went at the stop)
            return True
        # It ended on its own before its work was done (a crash, a kill): serve on from
        # the pool in this run rather than leave the job idle; what it left running (a
        # vLLM server, its engine core) would hold the GPU the cold start needs.
        # (ended by its own check, or by a crash or a kill)
        how = "failed its check prompt and ended" if restore_check.refused_in(
            self.backend.state_dir, self.restart_count) else "ended on its own"  # fmt: skip
        reason = f"starts anew: the restored instance (pid {pid}) {how} ({left})"
        ended = end_left_behind(tree)
        if ended:
            reason += f"; ended what it left running (pid {', '.join(map(str, ended))})"
        try:  # its weights may be why: read them only if whole
            found = self.backend.check_pool()
        except Exception as e:  # noqa: BLE001 - the start that follows says what it finds
            found = f"the pool entry could not be checked ({e})"
        if found:
            reason += f"; {found}"
        self._cold(result, reason)
        return False

    def _end(self, result: ServeResult, proxied: bool) -> None:
        """Everything a run gives back, each step on its own, the requeue last: also after
        an error a preempted job that is not requeued is lost work (a proxy's restored
        process asked for its own requeue when it parked)."""
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("give the engine back", lambda: self.backend.close(result, served=not proxied)),
        ]
        if not proxied and self.record_state is None:  # a restored process keeps its own
            steps.append(("drop the instance record",
                          lambda: self.registry.remove(self.instance_id)))  # fmt: skip
        steps.append(("release the GPU slot", self._release_slot))
        if (
            self.stop.stop_signal == "SIGUSR1"
            and self.job_id
            and self.requeue
            and not proxied
            and self.requeue_flag is not False
        ):
            # scancel --signal=USR1 --batch does not requeue by itself; preemption does,
            # and a second requeue of a job already pending is harmless. (Slurm refuses
            # one of a job it may not requeue: not asked.)
            job_id, requeue = self.job_id, self.requeue
            steps.append(("ask for the requeue", lambda: requeue(job_id)))
        run_steps(steps, self.log)

    def _release_slot(self, then: str = "") -> None:
        problem = self.slot.release()
        if problem:
            self.log(f"spswap serve: {problem}{then}")

    # -- the check of a restore ---------------------------------------------------------
    def _probe(self, when: str) -> CheckAnswer | None:
        t0 = time.perf_counter()
        try:
            answer = self.backend.probe()
        except Exception as e:  # noqa: BLE001 - no check then, but the dump goes on
            self.log(f"spswap serve: the check prompt got no answer {when} ({e}); the "
                     "restore will not be checked")  # fmt: skip
            answer = None
        # an answer kept from its first asking says how long that took
        kept_s = answer.asked_s if answer is not None else None
        self.probe_s = time.perf_counter() - t0 if kept_s is None else kept_s
        return answer

    def _check_restored(self, expected: CheckAnswer | None) -> str | None:
        """None when the restored instance answers as before (or no check); else why not."""
        return restore_check.refusal(expected, lambda: self.backend.probe(expected))

    # -- records ------------------------------------------------------------------------
    def _cold(self, result: ServeResult, reason: str) -> None:
        """This run starts cold where a restore was expected: why, in the job's log, the
        instance record and (with the run's line) ``runs.jsonl``."""
        self.reason = result.cold_reason = reason
        self.log(f"spswap serve: {reason}")

    def _note_run(self, path: RunPath, copy: dict[str, Any] | None = None) -> None:
        gb_per_s = copy.get("gb_per_s") if copy else None
        note_run(self.backend.state_dir, self.restart_count, path, started_s=self.started_s,
                 reason=self.reason, log=self.log, marks_s=self.marks_s,
                 copy_gb_per_s=float(gb_per_s)
                 if gb_per_s and math.isfinite(gb_per_s) else None)  # fmt: skip

    def _record(self, state: str) -> None:
        if self.record_state is not None:
            self.record_state(state)
            return
        self.registry.put_best_effort(InstanceRecord(
            id=self.instance_id, model=self.model_name, state=state, pid=os.getpid(),
            uid=os.getuid(), job_id=self.job_id, device=self.backend.device,
            engine=self.backend.engine, reason=record_note(state, self.reason),
        ), self.log)  # fmt: skip


def record_note(state: str, start_reason: str | None) -> str | None:
    """The note an instance record carries: how its run started (e.g. "starts anew: ...
    no checkpoint image"), while it runs; none once it is parked (the re-walk: a saved,
    kept-alive instance still said it had no checkpoint image). Pure."""
    return None if state == "checkpoint" else start_reason
