"""The slot table's state and its rules, as pure data: no files, no locks, no clock.

What is held (:class:`Reservation`), who waits (:class:`Waiter`, in ticket order) and
the next ticket make a :class:`SlotState`, the decoded ``slots/state.json``. Its methods
are the table's policy: strict FIFO per GPU (:meth:`SlotState.grant` places a request
only when no earlier waiter that could use one of the same GPUs still waits), reclaiming
what dead holders and waiters left (:meth:`SlotState.reclaim`, with the liveness probes
passed in) and releasing. :mod:`spswap.slots.table` runs them under the file lock.

No torch, CUDA, NVML or Slurm here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from spswap.errors import PermissionDenied, SlotError
from spswap.fsutil import STATE_VERSION
from spswap.liveness import Holder
from spswap.slots.alloc import UNITS_PER_GPU, allocate


@dataclass(frozen=True)
class Reservation:
    """Units of one GPU, or whole GPUs, granted to a holder for a model."""

    id: str
    gpus: tuple[int, ...]
    units: tuple[int, ...]
    """Unit indexes (0..3) taken on every GPU in ``gpus``; all four for whole GPUs."""
    holder: Holder
    model: str
    granted_at: float

    def unit_keys(self) -> set[tuple[int, int]]:
        """Every (gpu, unit) pair this reservation holds."""
        return {(g, u) for g in self.gpus for u in self.units}

    def describe(self) -> str:
        """One line for error messages: id, model, holder, since when, where."""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.granted_at))
        return (
            f"{self.id} (model {self.model}, {self.holder.describe()}, since {since}) "
            f"on {_where(self.gpus, self.units)}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "gpus": list(self.gpus), "units": list(self.units),
            "holder": self.holder.to_json(), "model": self.model, "granted_at": self.granted_at,
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Reservation:
        return cls(
            id=str(data["id"]), gpus=tuple(int(g) for g in data["gpus"]),
            units=tuple(int(u) for u in data["units"]), holder=Holder.from_json(data["holder"]),
            model=str(data["model"]), granted_at=float(data["granted_at"]),
        )  # fmt: skip


def _where(gpus: Sequence[int], units: Sequence[int]) -> str:
    if len(units) == UNITS_PER_GPU:
        return f"GPU {','.join(map(str, gpus))} (whole)"
    return f"GPU {gpus[0]} unit{'s' if len(units) > 1 else ''} {','.join(map(str, units))}"


@dataclass(frozen=True)
class SlotRequest:
    """What a reservation asks for: ``units`` of one GPU, or ``whole_gpus`` whole GPUs,
    among ``candidates``."""

    units: int
    whole_gpus: int | None
    candidates: tuple[int, ...]

    def describe(self) -> str:
        """``4 unit(s) on GPU 0``, ``1 unit(s) on one of GPUs 0,1``, ``2 whole GPU(s) of
        GPUs 0,1,2``. Pure."""
        where = ",".join(map(str, self.candidates))
        if self.whole_gpus is not None:
            return f"{self.whole_gpus} whole GPU(s) of GPUs {where}"
        if len(self.candidates) == 1:
            return f"{self.units} unit(s) on GPU {where}"
        return f"{self.units} unit(s) on one of GPUs {where}"


@dataclass(frozen=True)
class WaitingProcess:
    """The process that waits in line (it may differ from the holder: a shell that
    outlives a killed ``spswap slots reserve`` is the holder, the command the waiter)."""

    pid: int
    pid_start: int | None

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "pid_start": self.pid_start}


@dataclass(frozen=True)
class Waiter:
    """One place in the queue, as ``state.json`` keeps it."""

    ticket: int
    model: str
    units: int
    whole_gpus: int | None
    candidates: tuple[int, ...]
    holder: Holder
    waiter: WaitingProcess | None  # None only in entries written before it was recorded
    enqueued_at: float

    @property
    def process(self) -> WaitingProcess:
        """The process whose life the place in line lasts (the holder's when unrecorded)."""
        return self.waiter or WaitingProcess(self.holder.pid, self.holder.pid_start)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ticket": self.ticket, "model": self.model, "units": self.units,
            "whole_gpus": self.whole_gpus, "candidates": list(self.candidates),
            "holder": self.holder.to_json(),
        }  # fmt: skip
        if self.waiter is not None:
            out["waiter"] = self.waiter.to_json()
        out["enqueued_at"] = self.enqueued_at
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Waiter:
        w = data.get("waiter")
        return cls(
            ticket=int(data["ticket"]), model=str(data["model"]), units=int(data["units"]),
            whole_gpus=None if data.get("whole_gpus") is None else int(data["whole_gpus"]),
            candidates=tuple(int(g) for g in data["candidates"]),
            holder=Holder.from_json(data["holder"]),
            waiter=WaitingProcess(int(w["pid"]), w.get("pid_start")) if w else None,
            enqueued_at=float(data.get("enqueued_at", 0.0)),
        )  # fmt: skip


HolderAlive = Callable[[Holder], bool]
ProcessAlive = Callable[[int, "int | None"], bool]


@dataclass
class SlotState:
    """The decoded state file; ``dirty`` says it must be written back, ``reclaimed`` what
    the last :meth:`reclaim` dropped."""

    reservations: list[Reservation] = field(default_factory=list)
    queue: list[Waiter] = field(default_factory=list)
    next_ticket: int = 1
    dirty: bool = False
    reclaimed: list[Reservation] = field(default_factory=list)

    # -- the file's form ---------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION, "reservations": [r.to_json() for r in self.reservations],
            "queue": [w.to_json() for w in self.queue], "next_ticket": self.next_ticket,
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SlotState:
        """The state of a file already checked to be of :data:`STATE_VERSION`."""
        return cls(
            [Reservation.from_json(r) for r in data.get("reservations", [])],
            [Waiter.from_json(q) for q in data.get("queue", [])],
            int(data.get("next_ticket", 1)),
        )

    # -- reading -----------------------------------------------------------------------

    def held(self) -> dict[int, set[int]]:
        """GPU -> the units reservations hold on it."""
        out: dict[int, set[int]] = {}
        for r in self.reservations:
            for g in r.gpus:
                out.setdefault(g, set()).update(r.units)
        return out

    def waiters_ahead(self, ticket: int, req: SlotRequest) -> list[Waiter]:
        """Earlier waiters that could use one of the GPUs ``req`` could."""
        cands = set(req.candidates)
        return [w for w in self.queue if w.ticket < ticket and cands & set(w.candidates)]

    def in_line(self, ticket: int) -> bool:
        """Whether ticket ``ticket`` waits in the queue."""
        return any(w.ticket == ticket for w in self.queue)

    def blockers(self, req: SlotRequest) -> list[Reservation]:
        """Reservations on any GPU ``req`` could use."""
        return [r for r in self.reservations if set(r.gpus) & set(req.candidates)]

    # -- changing ----------------------------------------------------------------------

    def take_ticket(self) -> int:
        """The next place in line."""
        ticket = self.next_ticket
        self.next_ticket += 1
        self.dirty = True
        return ticket

    def grant(
        self, ticket: int, req: SlotRequest, holder: Holder, model: str, *, now: float,
        barred: Collection[int] = (),
    ) -> Reservation | None:  # fmt: skip
        """Place ``req`` for ticket ``ticket`` if it fits and no earlier waiter for the same
        GPUs is still in line; the reservation (the ticket leaves the queue), else None.
        ``barred``: GPUs of ``req`` it may not take now (it waits for the others).

        A ticket in line is judged by its place in line's GPUs, which :meth:`take_back`
        may have narrowed (the same GPUs then count for it and for those behind it); a
        place left with none raises :class:`SlotError`, and the ticket leaves the line."""
        req = self._as_in_line(ticket, req)
        if self.waiters_ahead(ticket, req):
            return None
        candidates = [g for g in req.candidates if g not in barred]
        placed = allocate(self.held(), candidates, units=req.units, whole_gpus=req.whole_gpus)
        if placed is None:
            return None
        gpus, units = placed
        r = Reservation(f"r{ticket}", gpus, units, holder, model, now)
        self.reservations.append(r)
        self.dequeue(ticket)
        self.dirty = True
        return r

    def _as_in_line(self, ticket: int, req: SlotRequest) -> SlotRequest:
        """``req`` with the GPUs its place in line still has (all of them before it is in
        line)."""
        for w in self.queue:
            if w.ticket == ticket:
                left = tuple(g for g in req.candidates if g in w.candidates)
                if len(left) < (req.whole_gpus or 1):
                    self.dequeue(ticket)
                    gone = "every GPU" if not left else f"all but {len(left)} of the GPUs"
                    raise SlotError(
                        f"{gone} this request could take ({req.describe()}) was taken back "
                        "while it waited: a reservation outside a job gives way to the job "
                        "Slurm gives its GPU to (`spswap events` names the job); run it "
                        "inside your job (sbatch or srun), where it takes your job's GPUs"
                    )  # fmt: skip
                return replace(req, candidates=left) if left != req.candidates else req
        return req

    def enqueue(self, waiter: Waiter) -> None:
        """Put ``waiter`` in line by its ticket (no-op when its ticket is there already)."""
        if self.in_line(waiter.ticket):
            return
        # Re-adding keeps the original ticket, so a state file moved aside mid-wait
        # does not cost this waiter its place.
        self.queue.append(waiter)
        self.queue.sort(key=lambda w: w.ticket)
        self.dirty = True

    def dequeue(self, ticket: int) -> None:
        """Take ticket ``ticket`` out of line, if it is there."""
        kept = [w for w in self.queue if w.ticket != ticket]
        if len(kept) != len(self.queue):
            self.queue = kept
            self.dirty = True

    def reclaim(self, holder_alive: HolderAlive, process_alive: ProcessAlive) -> None:
        """Drop reservations whose holder has gone (kept in :attr:`reclaimed`) and places
        in line whose waiting process has gone."""
        live = [r for r in self.reservations if holder_alive(r.holder)]
        if len(live) != len(self.reservations):
            self.reclaimed = [r for r in self.reservations if r not in live]
            self.reservations = live
            self.dirty = True
        # a place in line lives as long as the process that waits in it (the holder may be
        # a shell that outlives a killed `spswap slots reserve`)
        queue = [w for w in self.queue if process_alive(w.process.pid, w.process.pid_start)]
        if len(queue) != len(self.queue):
            self.queue = queue
            self.dirty = True

    def take_back(
        self, gpus: Collection[int], whose: Callable[[Holder], bool]
    ) -> list[Reservation]:
        """GPUs ``gpus`` taken from the holders ``whose`` picks: their reservations on
        them removed (returned), and their places in line no longer count them (so they
        hold back no one there; one left with none is refused at its next attempt)."""
        taken = set(gpus)
        gone = [r for r in self.reservations if whose(r.holder) and taken & set(r.gpus)]
        if gone:
            self.reservations = [r for r in self.reservations if r not in gone]
            self.dirty = True
        for i, w in enumerate(self.queue):
            if whose(w.holder) and taken & set(w.candidates):
                left = tuple(g for g in w.candidates if g not in taken)
                self.queue[i] = replace(w, candidates=left)
                self.dirty = True
        return gone

    def release(self, reservation_id: str, *, uid: int | None) -> Reservation:
        """Remove a reservation; ``uid`` (unless None or root) must be the holder's. One
        reclaimed by the last :meth:`reclaim` counts as released."""
        for r in self.reclaimed:
            if r.id == reservation_id:
                return r  # its holder had already gone: released either way
        for r in self.reservations:
            if r.id == reservation_id:
                if uid is not None and uid != 0 and uid != r.holder.uid:
                    raise PermissionDenied(
                        f"reservation {r.id} belongs to uid {r.holder.uid}, not to uid {uid}; "
                        "ask its owner or root to release it"
                    )
                self.reservations.remove(r)
                self.dirty = True
                return r
        current = ", ".join(r.id for r in self.reservations) or "none"
        raise SlotError(
            f"no reservation {reservation_id!r} (it may have been reclaimed after its holder "
            "ended, or, made outside a job, taken back for a job given its GPU: `spswap "
            f"events` says which); current reservations: {current}; see `spswap slots ls`"
        )


def build_snapshot(
    gpus: Sequence[int], reservations: Sequence[Reservation], queue: Sequence[Waiter]
) -> dict[str, Any]:
    """The JSON view of a table state (pure, so ``spswap status`` can render it too)."""
    all_gpus = sorted(set(gpus) | {g for r in reservations for g in r.gpus})
    per_gpu = []
    for g in all_gpus:
        owners: list[str | None] = [None] * UNITS_PER_GPU
        for r in reservations:
            if g in r.gpus:
                for u in r.units:
                    owners[u] = r.id
        per_gpu.append({
            "index": g, "units_total": UNITS_PER_GPU,
            "units_free": sum(o is None for o in owners), "units": owners,
            "known": g in gpus,
        })  # fmt: skip
    return {
        "version": STATE_VERSION, "gpus": per_gpu,
        "reservations": [r.to_json() for r in reservations],
        "waiters": [w.to_json() for w in queue],
    }  # fmt: skip
