"""A multi-model job's run through the one serve lifecycle
(:class:`spswap.serve.lifecycle.ServeRun`), so that a preemption of the whole job parks
and checkpoints every model at once, as it does a single model's:

  - prepare: the state directory, every model into the pool;
  - start: one engine process per model from the pool (the router), the endpoint on the
    job's socket, TCP with the key where asked;
  - serve: until the run's stop;
  - drain: the router takes no new request and starts no queued one; the answers being
    made get the run's drain time; a waiting client is told to ask again (by its
    ``X-Request-Id``, which keeps its request queued across the stop);
  - sleep: every awake model to sleep and every connection cut (a dump keeps none); the
    router process and its engine processes are one process tree, which spswapd parks
    and checkpoints whole (kept alive, or to an image);
  - wake: restored into the job's next run, the models placed awake wake; once the
    restore's check passed (serve), the endpoint opens again and the queued requests are
    answered in their order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spswap.access import PoolAccess
from spswap.checkpoint.images import DIGEST_SEP, config_hash, process_identity
from spswap.config import Config
from spswap.errors import PoolEntryNotFound, SpswapError
from spswap.multi.engine_settings import check_engine
from spswap.multi.http_api import ApiServer
from spswap.multi.placement import awake_slots
from spswap.multi.procs import ModelSpec
from spswap.multi.records import ModelRecords
from spswap.multi.router import Router
from spswap.multi.serve import MultiOptions, check_names, start_router
from spswap.multi.vllm_start import vllm_specs
from spswap.pool.manifest import Manifest
from spswap.serve import restore_check
from spswap.serve.backend import Log, ServeResult
from spswap.serve.checkpointer import DaemonCheckpointer
from spswap.serve.http_front import HttpFront, new_key
from spswap.serve.lifecycle import ServeRun
from spswap.serve.run_log import RunPath
from spswap.serve.slot_hold import RunSlot, StopSignals
from spswap.serve.spool_ask import write_multi_endpoint
from spswap.units import fmt_bytes


class MultiBackend:
    """The models of one job behind one endpoint (see the module doc)."""

    probe_at_start = False  # the awake models at a stop are checked: asked then
    checks_several = True

    def __init__(self, cfg: Config, opts: MultiOptions, *, job_id: str | None,
                 stop: StopSignals, log: Log) -> None:  # fmt: skip
        self.cfg, self.opts, self.job_id, self.stop, self.log = cfg, opts, job_id, stop, log
        self.engine = f"multi-{opts.engine}"
        self.device, self.state_dir = opts.device, opts.state_dir
        self.records = ModelRecords(cfg.paths.instances, job_id=job_id, engine=opts.engine,
                                    device=opts.device, log=log)  # fmt: skip
        self.pool = PoolAccess(cfg, job_id=job_id)  # through spswapd unless root
        self.specs: list[ModelSpec] = []
        self.imported_s = 0.0  # the newest of the models' pool entries (epoch seconds)
        self.router: Router | None = None
        self.api: ApiServer | None = None
        self.front: HttpFront | None = None
        self.last_summary: dict[str, Any] = {}
        self.manifests: list[Manifest] = []
        self.damaged: str | None = None  # what check_pool found wrong with an entry
        # each model's answer to the check prompt, asked at its first stop awake (probe),
        # and about how long that asking took
        self.check_answers: dict[str, tuple[int, ...]] = {}
        self.check_first_s: dict[str, float] = {}

    # -- before the slot ----------------------------------------------------------------
    def prepare(self, result: ServeResult) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        check_names(self.opts.models)
        check_engine(self.opts.engine, self.opts.device)  # refused before any model is read
        self._find_specs()
        result.digest = self._digest()

    def _find_specs(self) -> None:
        """Each model's pool entry (a reference model's imported now where missing)."""
        if self.opts.engine == "vllm":  # the entries of vLLM's identity, where exported
            self.specs, self.manifests = vllm_specs(self.pool, self.opts.models,
                                                    self.opts.vllm_settings())  # fmt: skip
            self.imported_s = max((m.created for m in self.manifests), default=0.0)
        else:
            manifests = {p: self._import(p) for p in self.opts.models}
            self.manifests = list(manifests.values())
            self.specs = [ModelSpec(p.name, p, m.digest) for p, m in manifests.items()]
            self.imported_s = max(m.created for m in manifests.values())

    def _import(self, path: Path) -> Manifest:
        """A reference model's pool entry; the job's log says when this run read it from
        the model's files (the run is then a cold one: its models later come up "from
        the pool", where this run put them)."""
        started = time.time()
        manifest = self.pool.import_checkpoint(path)
        if manifest.created >= started:
            self.log(
                f"spswap serve: {path.name} read from its files into the pool in "
                f"{time.time() - started:.2f} s ({fmt_bytes(manifest.data_size_bytes)})"
            )
        return manifest

    def _digest(self) -> str:
        """The models' pool entries, in their order, joined by ``+``: spswapd holds each
        of them while the job's image exists (its processes map them all)."""
        return DIGEST_SEP.join(s.digest for s in self.specs)

    def checkpoint_identity(self) -> dict[str, str]:
        missing = [s.name for s in self.specs if not s.digest]
        if missing:  # a vLLM model never exported: no image can hold its weights' entry
            raise PoolEntryNotFound(f"the weights of {', '.join(missing)} are not in the "
                                    "pool as vLLM holds them")  # fmt: skip
        o = self.opts
        fields: dict[str, Any] = {"engine": self.engine, "device": o.device,
                                  "units_per_model": o.units_per_model, "devices": o.devices,
                                  "max_awake": o.max_awake,
                                  "models": [s.name for s in self.specs]}  # fmt: skip
        if o.engine == "vllm":
            fields |= {"vllm": o.vllm_settings().to_json(), "vllm_args": o.vllm_args}
        cfg_hash = config_hash(fields)
        return process_identity(engine=self.engine, engine_version="",
                                model_digest=self._digest(), config_hash=cfg_hash)  # fmt: skip

    # -- serving ------------------------------------------------------------------------
    def start(self, result: ServeResult) -> RunPath:
        if self.damaged is not None:  # never serve from it
            raise SpswapError(f"not started: {self.damaged}")
        self.check_answers, self.check_first_s = {}, {}  # new engines: asked anew
        self.router = start_router(self.cfg, self.opts, job_id=self.job_id, log=self.log,
                                   on_state=self.records.update, specs=self.specs)  # fmt: skip
        # a vLLM model's first start exported its entry: the image's and the check's now
        self.specs = list(self.router.specs.values())
        self.manifests = [self.pool.find(s.digest) for s in self.specs]
        result.digest = self._digest()
        self._open()
        # imported by this run (its process started before the entries were made): cold
        return RunPath.COLD if self.imported_s >= result.started_s else RunPath.POOL

    def _open(self) -> None:
        assert self.router is not None
        self.api = ApiServer(self.router, self.opts.socket_path)
        self.api.start()
        write_multi_endpoint(self.state_dir, self.opts.socket_path, list(self.router.specs))
        awake = self.router.placement.awake()
        asleep = [n for n in self.router.specs if n not in awake]
        # which are awake now: a model "up from the pool" a line earlier may sleep already
        self.log(f"spswap serve: serving {len(self.router.specs)} models on "
                 f"{self.opts.socket_path} ({self.router.placement.slots} awake at once; "
                 f"awake: {', '.join(awake) or 'none'}"
                 + (f"; asleep until asked: {', '.join(asleep)})" if asleep else ")"))  # fmt: skip
        if self.opts.port is not None:
            key = new_key(self.state_dir / "api_key")
            self.front = HttpFront(self.opts.socket_path, key, self.opts.host, self.opts.port)
            self.log(f"spswap serve: also on {self.opts.host}:{self.front.start()} with the "
                     f"key in {self.state_dir / 'api_key'}")  # fmt: skip

    def _close_ways_in(self) -> None:
        front, self.front = self.front, None
        if front is not None:
            front.stop()
        api, self.api = self.api, None
        if api is not None:
            api.stop()

    def serve(self, result: ServeResult) -> None:
        assert self.router is not None
        # restored: answering again, and reachable, only once the check has passed (and
        # not at all when the next stop came meanwhile: the drain that follows expects
        # the router paused and the ways in closed)
        if not self.stop.stop_event.is_set():
            if self.router.paused:
                self.router.resume()
            if self.api is None:
                self._open()
        self.stop.stop_event.wait()

    def drain(self, result: ServeResult) -> None:
        assert self.router is not None
        running = self.router.pause(self.opts.drain_s)
        result.drain = {"queued": self.router.queued(), "still_answering": running}
        if running:
            self.log(f"spswap serve: {running} answer(s) still being made after the drain "
                     f"time ({self.opts.drain_s:g} s): a checkpoint of the job waits for "
                     "them; a stop without one cuts them")  # fmt: skip

    def sleep(self) -> None:
        assert self.router is not None
        self.router.sleep_all()  # after the answers being made: their clients get them
        self._close_ways_in()
        try:
            self.router.trim_all()
        except SpswapError as e:  # only a smaller image is lost
            self.log(f"spswap serve: could not trim the GPU memory before the dump ({e})")

    def wake(self, result: ServeResult) -> dict[str, Any]:
        assert self.router is not None
        woken = self.router.wake_all()  # (its ways in open in serve(), after the check)
        queued = self.router.queued()  # kept across the stop: the run's log counts them
        return {"woken": woken, "queued": queued, "saved_requests": queued}

    def probe(self, like: restore_check.CheckAnswer | None = None,
              ) -> restore_check.CheckAnswer | None:  # fmt: skip
        """The awake models' answers to the check prompt (the asleep ones come back from
        their pool entries, which :meth:`check_pool` reads against their checksums).
        Before a dump (``like`` None) a model asked once in this job is not asked again:
        its weights never change, and each answer asked at the stop holds the GPU from
        the job that preempts this one; after the restore every awake model is asked."""
        assert self.router is not None
        known = dict(self.check_answers) if like is None else None
        t0 = time.perf_counter()
        answers = self.router.probe_awake(list(restore_check.PROBE_PROMPT),
                                          restore_check.PROBE_TOKENS, known)  # fmt: skip
        asked_s = time.perf_counter() - t0
        if not answers:
            return None
        tokens = tuple(t for answer in answers.values() for t in answer)
        if like is not None:
            return restore_check.CheckAnswer(tokens)
        new = [name for name in answers if name not in self.check_answers]
        self.check_answers.update(answers)
        self.check_first_s.update({name: asked_s / len(new) for name in new})
        first_s = sum(self.check_first_s[name] for name in answers)
        return restore_check.CheckAnswer(tokens, asked_s=first_s)

    def check_pool(self) -> str | None:
        found = []
        for manifest in self.manifests:  # every model's: the cold start reads them all
            problem = self.pool.check(manifest.digest)
            if problem is None:
                continue
            if self.pool.has(manifest.digest):  # not removed: never serve from it
                self.damaged = problem
                return problem
            found.append(f"{problem}; {manifest.name} starts from its files, into the "
                         "pool again")  # fmt: skip
        if found:
            self._find_specs()
        return "; ".join(found) or None

    def left_undone(self) -> str | None:
        return f"its {len(self.specs)} models were to be served until stopped"

    def note_state(self, state: str) -> None:
        """The lifecycle's instance state: each model's row says it ("checkpoint" while
        parked; at "up" each is up or asleep as placed)."""
        if self.router is None:
            return
        for name in self.router.specs:
            if state == "up":
                self.records.update(name, self.router.metrics[name].awake)
            else:
                self.records.mark(name, state)

    def close(self, result: ServeResult, *, served: bool) -> None:
        steps: list[tuple[str, Callable[[], Any]]] = []
        end_engines = "end the models' engines"  # (the end line says whether it was done)
        if served:
            steps.append(("close the endpoint", self._close_ways_in))
            if self.router is not None:
                router = self.router
                steps.append((end_engines, router.close))
        steps.append(("remove the models' rows", self.records.remove_all))
        failed = set()
        for what, step in steps:
            try:
                step()
            except (SpswapError, OSError) as e:
                failed.add(what)
                self.log(f"spswap serve: could not {what} ({e})")
        if self.router is not None:
            metrics = self.router.metrics
            self.last_summary = {
                "metrics": self.router.metrics_text(),
                "answered": {n: m.requests.get("ok", 0) for n, m in metrics.items()},
                "failed": {n: m.requests.get("error", 0) for n, m in metrics.items()},
                "engines_ended": served and end_engines not in failed,
            }


def multi_run(cfg: Config, opts: MultiOptions, *, job_id: str | None = None,
              restart_count: int = 0, requeue: Callable[[str], None] | None = None,
              checkpointer: DaemonCheckpointer | None = None,
              log: Log = print) -> ServeRun[MultiBackend]:  # fmt: skip
    """A run of a multi-model job; then ``install_signal_handlers()`` and ``run()``. The
    job holds its awake models' share of its GPU on the node's slot table."""
    n_awake = awake_slots(len(opts.models), opts.units_per_model, opts.devices, opts.max_awake)
    slot = RunSlot(cfg, model="+".join(p.name for p in opts.models),
                   units=min(4, n_awake * opts.units_per_model), gpus=opts.slot_gpus,
                   job_id=job_id, timeout_s=opts.slot_timeout_s)  # fmt: skip
    stop = StopSignals(slot)
    backend = MultiBackend(cfg, opts, job_id=job_id, stop=stop, log=log)
    return ServeRun(cfg, backend, stop, model_name=slot.model, job_id=job_id,
                    restart_count=restart_count, requeue=requeue, checkpointer=checkpointer,
                    log=log, record_state=backend.note_state)  # fmt: skip


def serve_models(cfg: Config, opts: MultiOptions, *, job_id: str | None = None,
                 restart_count: int = 0, requeue: Callable[[str], None] | None = None,
                 checkpointer: DaemonCheckpointer | None = None, log: Log = print,
                 stop: threading.Event | None = None) -> dict[str, Any]:  # fmt: skip
    """Serve the models until SIGTERM/USR1 (or ``stop`` is set; signals are handled only
    on the main thread); returns a summary (the models, the stop, the last metrics)."""
    run = multi_run(cfg, opts, job_id=job_id, restart_count=restart_count, requeue=requeue,
                    checkpointer=checkpointer, log=log)  # fmt: skip
    if stop is not None:
        run.stop.stop_event = stop
    if threading.current_thread() is threading.main_thread():
        run.install_signal_handlers()
    result = run.run()
    return {"models": [p.name for p in opts.models], "stopped_by": result.stopped_by,
            "restored_pid": result.restored_pid, "cold_reason": result.cold_reason,
            "restart_count": result.restart_count,
            "events": result.events,
            # (what the models did: none of it where the router never started)
            "metrics": "", "answered": {}, "failed": {}, "engines_ended": False,
            **run.backend.last_summary}  # fmt: skip
