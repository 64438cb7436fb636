"""The start of a multi-model job's engine processes, all at once or one at a time
(:mod:`spswap.multi.engine_settings` says which, and in what order)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spswap.multi.engine_settings import one_at_a_time, start_order
from spswap.multi.placement import ModelState
from spswap.multi.procs import ModelProc, ModelSpec, close_all

Started = Callable[[str, ModelProc], None]  # (model, its process) once it is up


def _said(name: str, proc: ModelProc) -> str:
    """The job log's line for a model that is up."""
    hello = proc.hello
    if hello.get("from") == "checkpoint":
        why = f" ({hello['damaged']})" if hello.get("damaged") else ""
        return (f"spswap serve: {name} started cold from its files and exported to the pool "
                f"in {proc.load_s:.2f} s{why}")  # fmt: skip
    return f"spswap serve: {name} up from the pool in {proc.load_s:.2f} s"


def start_procs(specs: dict[str, ModelSpec], states: dict[str, ModelState], *, engine: str,
                make: Callable[[ModelSpec, bool], ModelProc], log: Callable[[str], None],
                on_started: Started | None = None) -> dict[str, ModelProc]:  # fmt: skip
    """Every model's engine process, up and placed (those placed asleep asleep).
    ``make(spec, wait_go)`` makes a process. One at a time (vLLM): every process imports
    its engine at once, then each loads in :func:`start_order` after the one before is
    up (and asleep where placed so); else all load at once. ``on_started`` sees each
    model up before it is put to sleep. On an error every process made is closed and
    the error raised again."""
    sequential = one_at_a_time(engine)
    procs: dict[str, ModelProc] = {}
    try:
        for name, spec in specs.items():
            procs[name] = make(spec, sequential)
        order = start_order(states) if sequential else [
            (n, states[n] is ModelState.ASLEEP) for n in specs]  # fmt: skip
        if sequential:
            for name, sleep_after in order:
                procs[name].go()
                procs[name].wait_ready()
                log(_said(name, procs[name]))
                _placed(name, procs[name], sleep_after, on_started)
        else:
            for name in specs:
                procs[name].wait_ready()
                log(_said(name, procs[name]))
            for name, sleep_after in order:
                _placed(name, procs[name], sleep_after, on_started)
    except BaseException:
        close_all(procs.values(), close_timeout_s(engine))
        raise
    return procs


def _placed(name: str, proc: ModelProc, sleep_after: bool, on_started: Started | None) -> None:
    if on_started is not None:
        on_started(name, proc)
    if sleep_after:
        proc.call("sleep")


def close_timeout_s(engine: str) -> float:
    """How long an engine process gets to close before it is killed (vLLM's engine core
    shuts down in a few seconds; killed early, it could outlive its parent on the GPU)."""
    return 60.0 if engine == "vllm" else 10.0


def spec_with(spec: ModelSpec, hello: dict[str, Any]) -> ModelSpec:
    """``spec`` with the pool entry its engine started from (a vLLM model exported at
    its first start gets its digest only then)."""
    digest = str(hello.get("digest") or spec.digest)
    return spec if digest == spec.digest else ModelSpec(spec.name, spec.path, digest)
