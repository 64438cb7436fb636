"""What the serve lifecycle (:mod:`spswap.serve.lifecycle`) drives and what a run
gives back: the :class:`Backend` protocol, one per engine (the reference engine's
runtime, vLLM's server, the multi-model router), and the run's :class:`ServeResult`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from spswap.serve.restore_check import CheckAnswer
from spswap.serve.run_log import RunPath

Log = Callable[[str], None]


@dataclass
class ServeResult:
    """What a run did, for ``spswap serve --json`` and the tests (both engines)."""

    restart_count: int = 0  # the run it ended as (a restored process ends in a later one)
    started_s: float = 0.0  # when this run's process started (epoch seconds)
    path: RunPath | None = None  # how it came to serve itself; None: it did not start one
    digest: str = ""  # the pool entry of the weights it served
    start_s: float | None = None  # seconds from asking the engine to start to serving
    stopped_by: str | None = None  # the signal that stopped it (None: it ended by itself)
    restored_pid: int | None = None  # the restored instance this run stood in for
    cold_reason: str | None = None  # why a run that could have restored started cold
    resumed: int = 0  # (reference) requests found saved by an earlier run
    answered: int = 0  # (reference) requests answered with tokens
    answered_before: int = 0  # (reference) of answered: those of earlier runs (a restored one)
    refused: int = 0  # (reference) requests answered with an error (bad input)
    pending_left: int = 0  # (reference) requests left in the spool for the next run
    copy: dict[str, Any] | None = None  # the start's copy from the pool (its gb_per_s)
    pack: dict[str, Any] | None = None  # (vllm) the start's packing of the weights
    drain: dict[str, Any] | None = None  # (vllm) the last stop's drain
    stop_s: float | None = None  # (vllm) how long stopping the server took
    events: list[dict[str, Any]] = field(default_factory=list)  # restores, failed dumps

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = self.path.value if self.path is not None else None
        return d


class Backend(Protocol):
    """One engine's server, as the lifecycle drives it. Methods run in this order:
    prepare, then start (or nothing, when a restored instance serves the run), then
    serve / drain / sleep / wake as stops and restores come, and close at the end."""

    engine: str  # "reference", "vllm": named in the instance record
    device: str
    state_dir: Path  # the job's state directory (runs.jsonl, the spool, the sockets)
    # True: the check prompt's answer is taken once, when the engine is first up (one
    # model, whose weights never change while it serves), not on the stop's path, where
    # it would keep the GPU from the job that preempts this one; False: at each stop (a
    # multi-model job: which models are awake changes as it serves)
    probe_at_start: bool
    # several models each answer the check (a multi-model job): the log's line says so
    checks_several: bool

    def prepare(self, result: ServeResult) -> None:
        """Before the GPU slot: the state directory, saved requests, the model in the
        pool; raise (SpswapError) here rather than after a slot is taken."""
        ...

    def checkpoint_identity(self) -> dict[str, str]:
        """What this instance names of itself at a dump and expects at a restore (the
        same fields both times, or the image is refused); SpswapError (a cold start,
        with its reason) when there is nothing a restore could be checked against."""
        ...

    def start(self, result: ServeResult) -> RunPath:
        """Start the engine (from the pool, or cold) and open its ways in; returns how."""
        ...

    def serve(self, result: ServeResult) -> None:
        """Serve until the run's stop event is set or the work is done; raises when the
        engine died under it."""
        ...

    def drain(self, result: ServeResult) -> None:
        """At a stop: take no new request; those running get the run's drain time."""
        ...

    def sleep(self) -> None:
        """Before a dump: the engine out of the GPU and nothing connected (a dump cannot
        keep connections). SpswapError or OSError: not checkpointed."""
        ...

    def wake(self, result: ServeResult) -> dict[str, Any]:
        """Restored into a later run: weights back from the pool; returns what to add to
        the restore's event. Nothing is answered before the restore's check passed: the
        ways in that answer at once open again in :meth:`serve`."""
        ...

    def left_undone(self) -> str | None:
        """What a serving instance of this run would still have to do, in words (e.g.
        "3 request(s) unanswered"), or None when its work is done."""
        ...

    def probe(self, like: CheckAnswer | None = None) -> CheckAnswer | None:
        """The engine's greedy answer to a fixed check prompt, asked at the start or before
        a dump (``like`` None; see :attr:`probe_at_start`) and after the restore's wake as
        ``like`` was (:func:`restore_check.difference` compares them); None where this
        engine has no such check (the restore is trusted)."""
        ...

    def check_pool(self) -> str | None:
        """A restored instance failed (its check, or it died): before the cold start that
        follows, make sure the pool entry it would read is whole; returns what was found
        wrong and what the start does instead (in words), or None."""
        ...

    def close(self, result: ServeResult, *, served: bool) -> None:
        """At the end, also after an error: give back what the backend holds (``served``
        False: a restored instance served this run and owns the engine and its fronts)."""
        ...
