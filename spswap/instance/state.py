"""The instance state machine, as plain bookkeeping (no torch, no CUDA, no CRIU).

    Saved  <-restore/dump->  Checkpoint  <-cuda_restore/cuda_checkpoint->  Sleep  <-wake/sleep->  Up

- Saved: a checkpoint image on tmpfs or disk, no process.
- Checkpoint: the process is alive but holds no GPU state.
- Sleep: the CUDA context is on the GPU, the weights are discarded.
- Up: serving.

Each transition is one named primitive. The object only records the state and its
history; the caller performs the work and calls :meth:`Instance.apply` around it
(``begin`` before, ``commit`` after), so a failed step leaves the old state recorded.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from spswap.errors import IllegalTransition


class State(str, enum.Enum):
    SAVED = "saved"
    CHECKPOINT = "checkpoint"
    SLEEP = "sleep"
    UP = "up"


class Primitive(str, enum.Enum):
    """The named transitions; the value is what events and logs show."""

    SLEEP = "sleep"  # Up -> Sleep: discard weights from the GPU
    WAKE = "wake"  # Sleep -> Up: weights back from the pool
    CUDA_CHECKPOINT = "cuda_checkpoint"  # Sleep -> Checkpoint: GPU state to host
    CUDA_RESTORE = "cuda_restore"  # Checkpoint -> Sleep: GPU state back
    DUMP = "dump"  # Checkpoint -> Saved: CRIU image, process gone
    RESTORE = "restore"  # Saved -> Checkpoint: CRIU restore


TRANSITIONS: dict[Primitive, tuple[State, State]] = {
    Primitive.SLEEP: (State.UP, State.SLEEP),
    Primitive.WAKE: (State.SLEEP, State.UP),
    Primitive.CUDA_CHECKPOINT: (State.SLEEP, State.CHECKPOINT),
    Primitive.CUDA_RESTORE: (State.CHECKPOINT, State.SLEEP),
    Primitive.DUMP: (State.CHECKPOINT, State.SAVED),
    Primitive.RESTORE: (State.SAVED, State.CHECKPOINT),
}


def can_apply(state: State, primitive: Primitive) -> bool:
    """Whether ``primitive`` starts from ``state``."""
    return TRANSITIONS[primitive][0] is state


def path(src: State, dst: State) -> list[Primitive]:
    """The primitives that lead from ``src`` to ``dst`` (the states form a line)."""
    order = [State.SAVED, State.CHECKPOINT, State.SLEEP, State.UP]
    i, j = order.index(src), order.index(dst)
    steps: list[Primitive] = []
    while i != j:
        nxt = i + 1 if j > i else i - 1
        for prim, (a, b) in TRANSITIONS.items():
            if a is order[i] and b is order[nxt]:
                steps.append(prim)
                break
        i = nxt
    return steps


@dataclass
class Instance:
    """One model instance's state and the history of its transitions."""

    name: str
    state: State = State.UP
    history: list[dict[str, Any]] = field(default_factory=list)
    _pending: Primitive | None = field(default=None, repr=False)

    def begin(self, primitive: Primitive) -> None:
        """Check that ``primitive`` may start now; raise :class:`IllegalTransition` if not."""
        if self._pending is not None:
            raise IllegalTransition(
                f"{self.name}: {primitive.value} asked while {self._pending.value} is still "
                "running; wait for it to finish"
            )
        src, dst = TRANSITIONS[primitive]
        if self.state is not src:
            legal = [p.value for p in Primitive if can_apply(self.state, p)]
            raise IllegalTransition(
                f"{self.name}: cannot {primitive.value} from state {self.state.value} "
                f"({primitive.value} goes {src.value} -> {dst.value}); from "
                f"{self.state.value} the legal steps are: {', '.join(legal)}"
            )
        self._pending = primitive

    def commit(self, duration_s: float) -> State:
        """Record that the pending primitive succeeded."""
        if self._pending is None:
            raise IllegalTransition(f"{self.name}: commit without a primitive begun")
        prim = self._pending
        src, dst = TRANSITIONS[prim]
        self.state = dst
        self._pending = None
        self.history.append(
            {"primitive": prim.value, "from": src.value, "to": dst.value,
             "duration_s": duration_s, "at": time.time()}
        )  # fmt: skip
        return dst

    def abort(self) -> None:
        """The pending primitive failed: the state stays as it was."""
        self._pending = None

    @contextmanager
    def step(self, primitive: Primitive) -> Iterator[None]:
        """``begin``, run the block, then ``commit`` with its duration (or ``abort`` if it
        raised): the one way engines record a transition."""
        self.begin(primitive)
        start = time.perf_counter()
        try:
            yield
        except BaseException:
            self.abort()
            raise
        self.commit(time.perf_counter() - start)

    @property
    def last_duration_s(self) -> float:
        """Seconds the last committed primitive took."""
        return float(self.history[-1]["duration_s"]) if self.history else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "state": self.state.value, "history": self.history}
