"""The router of a multi-model job: per-model queues in front of the engine processes,
the :class:`~spswap.multi.placement.Placement` deciding who is awake, and the metrics.

Each model has its own queue and its own thread that answers it in order, so a model
being woken holds up only its own requests (no head-of-line blocking). Swaps are made
one at a time under one condition (a device's copies do not overlap usefully); a model
that is answering is never put to sleep: a wake that needs its slot waits for the answer.

At a stop of the job (:meth:`Router.pause`): the answers being made finish, the queued
requests stay queued (a checkpoint of the job carries them) and are answered once the
restored job :meth:`Router.resume` s. A request asked with an id is found by that id
(:meth:`Router.submit`): its client, cut off by the stop, asks again with the same id.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from spswap.errors import RequestRejected, SpswapError
from spswap.multi.metrics import ModelMetrics, render
from spswap.multi.placement import ModelState, Placement, SwapCause
from spswap.multi.procs import ModelProc, ModelSpec, close_all, no_model_text
from spswap.multi.startup import Started, close_timeout_s, spec_with, start_procs

IDLE_CHECK_S = 0.2
MAX_KEPT_BY_ID = 4096  # requests findable by their id (the oldest forgotten first)


@dataclass(frozen=True)
class Ask:
    """One completion request for one model, with its arrival time."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    arrived_s: float
    model: str = ""


class Router:
    """Serves several models of one job. :meth:`start`, then :meth:`submit` from any
    thread; :meth:`close` at the end."""

    def __init__(self, specs: list[ModelSpec], *, slots: int, engine: str = "reference",
                 device: str = "cpu", root: Any, job_id: str | None = None,
                 idle_timeout_s: float | None = None,
                 log: Callable[[str], None] = print,
                 on_state: Callable[[str, bool], None] | None = None,
                 engine_settings: dict[str, Any] | None = None, vllm_args: str = "",
                 pack_slot_share: float | None = None,
                 on_started: Started | None = None) -> None:  # fmt: skip
        self.specs = {s.name: s for s in specs}
        self.placement = Placement(tuple(self.specs), slots)
        self.engine = engine
        self._new_proc = functools.partial(  # each model's engine process, the same options
            ModelProc, engine=engine, device=device, root=root, job_id=job_id,
            settings=engine_settings, vllm_args=vllm_args, pack_slot_share=pack_slot_share,
        )  # fmt: skip
        self.idle_timeout_s = idle_timeout_s
        self.log = log
        self.on_state = on_state  # (model, awake) after each change: spswap status's rows
        self.on_started = on_started  # each model up, before it is placed (bench traffic)
        self.procs: dict[str, ModelProc] = {}
        self.metrics = {n: ModelMetrics() for n in self.specs}
        self.queues: dict[str, queue.Queue[tuple[Ask, Future[dict[str, Any]]] | None]] = {
            n: queue.Queue() for n in self.specs
        }
        self._cond = threading.Condition()
        self._swap_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._running = threading.Event()  # clear while the job is stopping (paused)
        self._running.set()
        self._busy = 0  # answers being made now (under _cond)
        self._by_id: OrderedDict[str, tuple[Ask, Future[dict[str, Any]]]] = OrderedDict()
        self.swap_log_s: list[float] = []  # every demand swap's seconds (bench traffic)

    # -- life ------------------------------------------------------------------------
    def start(self) -> None:
        """Start every engine process (vLLM's one at a time: :func:`start_procs`), those
        placed asleep put to sleep."""

        self.procs = start_procs(self.specs, self.placement.states, engine=self.engine,
                                 make=lambda spec, wait_go: self._new_proc(spec, wait_go=wait_go),
                                 log=self.log, on_started=self.on_started)  # fmt: skip
        try:
            for name, proc in self.procs.items():
                self.specs[name] = spec_with(self.specs[name], proc.hello)
                self._refresh(name)
        except BaseException:
            self.close()
            raise
        with self._cond:
            self.placement.touch_all(time.monotonic())
        for name in self.specs:
            t = threading.Thread(target=self._serve_model, args=(name,), daemon=True,
                                 name=f"spswap-model-{name}")  # fmt: skip
            t.start()
            self._threads.append(t)
        if self.idle_timeout_s is not None:
            t = threading.Thread(target=self._idle_loop, daemon=True, name="spswap-idle")
            t.start()
            self._threads.append(t)

    def measure_swap_s(self) -> float:
        """One sleep + wake of the first model, in seconds: the swap budget's estimate."""
        name = next(iter(self.specs))
        with self._swap_lock:
            asleep = self.placement.states[name] is ModelState.ASLEEP
            t0 = time.perf_counter()
            if not asleep:
                self.procs[name].call("sleep")
            self.procs[name].call("wake")
            took = time.perf_counter() - t0
            if asleep:
                self.procs[name].call("sleep")
        return took

    def close(self) -> None:
        """Stop the model threads (queued requests are answered with an error) and end
        every engine process."""
        self._stop.set()
        self._running.set()  # paused threads go on, to answer their requests with the error
        for q in self.queues.values():
            q.put(None)
        for t in self._threads:
            t.join(30)
        for q in self.queues.values():
            while True:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                if item is not None and not item[1].done():
                    item[1].set_exception(SpswapError("the server is stopping"))
        close_all(self.procs.values(), close_timeout_s(self.engine))

    def set_awake(self, slots: int) -> list[str]:
        """At most ``slots`` models awake from now on (bench traffic's one- vs
        two-resident, between its runs): the least recently used idle ones beyond go to
        sleep; returns them."""
        with self._cond:
            victims = self.placement.resize(slots)
            self.placement.swapping.update(victims)
        try:
            with self._swap_lock:
                for name in victims:
                    self._sleep(name, SwapCause.IDLE)
        finally:
            with self._cond:
                self.placement.end_swap(tuple(victims))
                self._cond.notify_all()
        return victims

    def trim_all(self) -> dict[str, dict[str, Any]]:
        """Every model asleep (before a checkpoint): cached device blocks (vLLM's) and
        each engine process's freed heap given back, a smaller image. Returns each
        model's answer (what was given back)."""
        return {name: proc.call("trim") for name, proc in self.procs.items()}

    # -- a stop of the job -------------------------------------------------------------
    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def pause(self, timeout_s: float) -> int:
        """Take no new request and start no queued one; wait up to ``timeout_s`` for the
        answers being made. Returns how many were still being made."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._running.clear()
            while self._busy and time.monotonic() < deadline:
                self._cond.wait(min(IDLE_CHECK_S, max(0.0, deadline - time.monotonic())))
            return self._busy

    def sleep_all(self) -> list[str]:
        """Before a checkpoint (paused): every awake model to sleep (each after the answer
        it is making), the placement unchanged; returns the models put to sleep."""
        return self._call_awake("sleep")

    def wake_all(self) -> list[str]:
        """Restored: the models placed awake are woken again; returns them."""
        woken = self._call_awake("wake")
        for name in woken:
            self._refresh(name)
        with self._cond:
            self.placement.touch_all(time.monotonic())
        return woken

    def _call_awake(self, op: str) -> list[str]:
        """``op`` on every model the placement has awake, one at a time (the swap lock);
        returns those models."""
        done = []
        with self._swap_lock:
            for name in self.specs:
                if self.placement.states[name] is ModelState.AWAKE:
                    self.procs[name].call(op)
                    done.append(name)
        return done

    def probe_awake(self, prompt_ids: list[int], max_new_tokens: int,
                    known: Mapping[str, tuple[int, ...]] | None = None,
                    ) -> dict[str, tuple[int, ...]]:  # fmt: skip
        """Every awake model's greedy answer to ``prompt_ids``, in the job's order (empty:
        none awake), those in ``known`` taken from there; no request, no metrics. Asked
        before a checkpoint and after the restore's :meth:`wake_all`, the two must be
        equal (:mod:`spswap.serve.restore_check`)."""
        out: dict[str, tuple[int, ...]] = {}
        with self._swap_lock:
            for name in self.specs:
                if self.placement.states[name] is not ModelState.AWAKE:
                    continue
                if known is not None and name in known:
                    out[name] = known[name]
                    continue
                answer = self.procs[name].call("generate", prompt_ids=list(prompt_ids),
                                               max_new_tokens=max_new_tokens)  # fmt: skip
                out[name] = tuple(int(t) for t in answer["token_ids"])
        return out

    def resume(self) -> None:
        """Serve again: the queued requests are answered in their order."""
        with self._cond:
            self._running.set()
            self._cond.notify_all()

    def queued(self) -> int:
        """Requests waiting in the models' queues."""
        return sum(q.qsize() for q in self.queues.values())

    # -- requests --------------------------------------------------------------------
    def submit(self, model: str, prompt_ids: list[int], max_new_tokens: int,
               request_id: str | None = None) -> Future[dict[str, Any]]:  # fmt: skip
        """Queue a request for ``model``; the future's result is the worker's answer
        (``token_ids``, timings). Unknown models raise RequestRejected at once. A
        ``request_id`` asked before gives that request's future again (pending, or with
        its answer), also across a stop and restore of the job."""
        if model not in self.specs:
            raise RequestRejected(no_model_text(model, self.specs))
        ask = Ask(tuple(prompt_ids), int(max_new_tokens), time.monotonic(), model)
        if request_id is not None:
            with self._cond:
                known = self._by_id.get(request_id)
                if known is not None:
                    if (known[0].model, known[0].prompt_ids, known[0].max_new_tokens) != \
                            (ask.model, ask.prompt_ids, ask.max_new_tokens):  # fmt: skip
                        raise RequestRejected(f"request id {request_id!r} was asked before "
                                              "with another model, prompt or max_tokens; "
                                              "give a new id for a new request")  # fmt: skip
                    self._by_id.move_to_end(request_id)
                    return known[1]
        if self._stop.is_set() or self.paused:
            raise SpswapError("the job is stopping (preempted, requeued or cancelled); ask "
                              "again once it runs again")  # fmt: skip
        fut: Future[dict[str, Any]] = Future()
        if request_id is not None:
            with self._cond:
                self._by_id[request_id] = (ask, fut)
                while len(self._by_id) > MAX_KEPT_BY_ID:
                    self._by_id.popitem(last=False)
        self.queues[model].put((ask, fut))
        self.metrics[model].queue_length = self.queues[model].qsize()
        return fut

    def _serve_model(self, name: str) -> None:
        q = self.queues[name]
        while True:
            item = q.get()
            if item is None:
                return
            ask, fut = item
            with self._cond:  # a stop holds it here: a checkpoint keeps it queued
                while self.paused and not self._stop.is_set():
                    self._cond.wait(IDLE_CHECK_S)
                self._busy += 1  # with the check: pause() then waits for this answer
            self.metrics[name].queue_length = q.qsize()
            try:
                if self._stop.is_set():
                    if not fut.done():
                        fut.set_exception(SpswapError("the server is stopping"))
                elif fut.set_running_or_notify_cancel():  # else its client left at a stop
                    fut.set_result(self._answer(name, ask))
            except Exception as e:  # noqa: BLE001 - a request never ends the router
                self.metrics[name].requests["error"] = (
                    self.metrics[name].requests.get("error", 0) + 1
                )
                fut.set_exception(e)
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def _answer(self, name: str, ask: Ask) -> dict[str, Any]:
        self._bring_up(name)
        try:
            out = self.procs[name].call("generate", prompt_ids=list(ask.prompt_ids),
                                        max_new_tokens=ask.max_new_tokens)  # fmt: skip
        finally:
            with self._cond:
                self.placement.end(name, time.monotonic())
                self._cond.notify_all()
        now = time.monotonic()
        mm = self.metrics[name]
        latency_s = now - ask.arrived_s
        mm.latency_s.observe(latency_s)
        mm.ttft_s.observe(latency_s - out["generate_s"] + out["first_token_s"])
        mm.requests["ok"] = mm.requests.get("ok", 0) + 1
        return {**out, "latency_s": latency_s, "answered_s": time.time()}

    def _bring_up(self, name: str) -> None:
        """Make ``name`` awake and busy: sleep the LRU idle awake model when needed. The
        plan is made under the condition; the swap itself runs outside it (other awake
        models keep answering) under the swap lock (one swap at a time)."""
        with self._cond:
            while True:
                plan = self.placement.plan_wake(name)
                if not plan.blocked:
                    break
                self._cond.wait(IDLE_CHECK_S)
            self.placement.begin_swap(name, plan, time.monotonic())
        if not plan.wake:
            return
        t0 = time.perf_counter()
        try:
            with self._swap_lock:
                for victim in plan.sleep:
                    self._sleep(victim, SwapCause.DEMAND)
                self.procs[name].call("wake")
        except BaseException:
            with self._cond:
                self.placement.mark(name, ModelState.ASLEEP)
                self.placement.end(name, time.monotonic())
                self.placement.end_swap(plan.sleep)
                self._cond.notify_all()
            raise
        took_s = time.perf_counter() - t0
        self.metrics[name].wake_s.observe(took_s)
        self.swap_log_s.append(took_s)
        with self._cond:
            self.placement.end_swap(plan.sleep)
            self._cond.notify_all()
        self._refresh(name)

    def _sleep(self, name: str, cause: SwapCause) -> None:
        """Put ``name`` to sleep (its placement already says asleep)."""
        self.procs[name].call("sleep")
        sleeps = self.metrics[name].sleeps
        sleeps[cause.value] = sleeps.get(cause.value, 0) + 1
        self._refresh(name)

    def _idle_loop(self) -> None:
        while not self._stop.wait(IDLE_CHECK_S):
            if self.paused:  # a stop's sleep_all owns the engines now
                continue
            with self._cond:
                idle = tuple(self.placement.idle_too_long(time.monotonic(),
                                                          self.idle_timeout_s))  # fmt: skip
                for name in idle:
                    self.placement.mark(name, ModelState.ASLEEP)
                self.placement.swapping.update(idle)
            with self._swap_lock:
                for name in idle:
                    try:
                        self._sleep(name, SwapCause.IDLE)
                    except SpswapError as e:
                        self.log(f"spswap serve: could not put idle {name} to sleep: {e}")
            with self._cond:
                self.placement.end_swap(idle)
                self._cond.notify_all()

    def _refresh(self, name: str) -> None:
        """The model's awake gauge and device memory, from its engine's health."""
        health = self.procs[name].call("health")
        self.metrics[name].awake = self.placement.states[name] is ModelState.AWAKE
        self.metrics[name].memory_bytes = int(health.get("resident_bytes", 0))
        if self.on_state is not None:
            self.on_state(name, self.metrics[name].awake)

    # -- views -----------------------------------------------------------------------
    def models(self) -> list[dict[str, Any]]:
        """``/v1/models``'s entries: each model with its state and queue."""
        return [{"id": n, "object": "model", "owned_by": "spswap",
                 "state": self.placement.states[n].value,
                 "queue_length": self.queues[n].qsize(),
                 "memory_bytes": self.metrics[n].memory_bytes}
                for n in self.specs]  # fmt: skip

    def metrics_text(self) -> str:
        for n in self.specs:
            self.metrics[n].queue_length = self.queues[n].qsize()
        return render(self.metrics)
