"""The node's GPU slot table: who holds which quarter of which GPU, and who waits.

Each GPU is divided into :data:`UNITS_PER_GPU` units. A reservation takes 1, 2 or 4
units of one GPU (buddy style: a pair of units starts at an even index, so 2+2 and
1+1+2 pack into one GPU) or N whole GPUs. The state (:mod:`spswap.slots.state`) lives
in one file under one lock (:mod:`spswap.slots.store`).

Waiters queue with a ticket and are served first come, first served: a request is
granted only when no earlier waiter that could use one of the same GPUs is still
waiting. Reservations whose holder has gone (process dead, Slurm job ended) and
waiters whose process has gone are dropped on every locked read. This module is the
wait loop around those rules.

No torch, CUDA, NVML or Slurm here: the GPU list and the job probe come from outside.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from spswap.config import Config
from spswap.liveness import Holder, JobProbe, holder_alive, pid_alive, pid_start_time
from spswap.slots.alloc import UNITS_PER_GPU
from spswap.slots.gpus import discover_gpus
from spswap.slots.request import make_request, timeout_error
from spswap.slots.state import (
    Reservation,
    SlotRequest,
    SlotState,
    Waiter,
    WaitingProcess,
    build_snapshot,
)
from spswap.slots.store import SlotStore

__all__ = ["UNITS_PER_GPU", "GrantCheck", "Reservation", "SlotTable", "build_snapshot"]

GrantCheck = Callable[[Holder], Collection[int]]
"""Called with the requester under the lock before every attempt to grant it a slot:
returns the GPUs it may not take now (it waits for the others), or raises to stop the
wait (the requester gives up its place in line)."""


class SlotTable:
    """GPU slot reservations of one node, kept in ``slots_dir`` (node-local tmpfs).

    ``grant_check`` (see :data:`GrantCheck`) lets a caller that waits on someone else's
    behalf (spswapd) stop when that someone has gone.
    """

    UNITS_PER_GPU = UNITS_PER_GPU

    def __init__(
        self,
        slots_dir: Path,
        gpus: Sequence[int],
        *,
        job_alive: JobProbe | None = None,
        poll_interval_s: float = 0.02,
        grant_check: GrantCheck | None = None,
    ) -> None:
        self.gpus: tuple[int, ...] = tuple(sorted(set(int(g) for g in gpus)))
        self.job_alive = job_alive
        self.poll_interval_s = poll_interval_s
        self.grant_check = grant_check
        self._store = SlotStore(slots_dir, self._reclaim)

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        *,
        gpus: Sequence[int] | None = None,
        job_alive: JobProbe | None = None,
        grant_check: GrantCheck | None = None,
    ) -> SlotTable:
        """The table under ``cfg.paths.slots``; GPUs default to :func:`discover_gpus`."""
        if gpus is None:
            gpus = [g.index for g in discover_gpus(cfg)]
        return cls(
            cfg.paths.slots, gpus, job_alive=job_alive, poll_interval_s=cfg.slot_poll_interval_s,
            grant_check=grant_check,
        )  # fmt: skip

    @property
    def slots_dir(self) -> Path:
        return self._store.slots_dir

    @property
    def state_path(self) -> Path:
        return self._store.state_path

    @property
    def lock_path(self) -> Path:
        return self._store.lock_path

    @property
    def read_only(self) -> bool:
        """True when this process cannot take the lock (a user: changes go through spswapd)."""
        return self._store.read_only

    # ---- public API -------------------------------------------------------------

    def reserve(
        self,
        *,
        model: str,
        units: int = UNITS_PER_GPU,
        whole_gpus: int | None = None,
        allowed_gpus: Sequence[int] | None = None,
        holder: Holder | None = None,
        timeout_s: float = 600.0,
    ) -> Reservation:
        """Reserve ``units`` (1, 2 or 4) of one GPU, or ``whole_gpus`` whole GPUs.

        Waits in FIFO order behind earlier requests for the same GPUs, polling every
        ``poll_interval_s``. Raises :class:`SlotTimeout` naming the holders after
        ``timeout_s``, and :class:`SlotError` for a request that can never be met.
        """
        req = make_request(self.gpus, units, whole_gpus, allowed_gpus)
        self._store.check_writable("reserve a slot")
        holder = Holder.current() if holder is None else holder
        deadline = time.monotonic() + timeout_s
        ticket: int | None = None
        queued = False
        try:
            while True:
                blockers: list[Reservation] | None = None
                with self._store.locked(deadline) as st:
                    if ticket is None:
                        ticket = st.take_ticket()
                    barred = () if self.grant_check is None else self.grant_check(holder)
                    granted = st.grant(ticket, req, holder, model, now=time.time(),
                                       barred=barred)  # fmt: skip
                    if granted is not None:
                        queued = False
                        return granted
                    if time.monotonic() >= deadline:
                        st.dequeue(ticket)
                        queued = False
                        blockers = st.blockers(req)
                        ahead = st.waiters_ahead(ticket, req)
                    else:
                        if not st.in_line(ticket):  # once: the waiter reads /proc
                            st.enqueue(_waiter(ticket, req, holder, model))
                        queued = True
                if blockers is not None:
                    raise timeout_error(req, model, timeout_s, blockers, ahead)
                time.sleep(self.poll_interval_s)
        except BaseException:
            if queued and ticket is not None:
                self._abandon(ticket)
            raise

    def release(self, reservation_id: str, *, uid: int | None = None) -> Reservation:
        """Give a reservation back; ``uid`` (unless root) must be the holder's."""
        self._store.check_writable("release a reservation")
        with self._store.locked() as st:
            return st.release(reservation_id, uid=uid)

    def take_back(self, gpus: Collection[int], whose: Callable[[Holder], bool], *,
                  timeout_s: float = 2.0) -> list[Reservation]:  # fmt: skip
        """Take ``gpus`` back from the holders ``whose`` picks (root's call: a running
        job's GPUs from reservations made outside any job), their reservations and their
        places in line (:meth:`SlotState.take_back`); returns the reservations."""
        self._store.check_writable("take back reservations")
        with self._store.locked(time.monotonic() + timeout_s) as st:
            return st.take_back(gpus, whose)

    def reservations(self) -> list[Reservation]:
        """Live reservations (stale ones are reclaimed first)."""
        with self._store.view() as st:
            return list(st.reservations)

    def waiters(self) -> list[Waiter]:
        """Queued requests in ticket order (dead waiters dropped first)."""
        with self._store.view() as st:
            return list(st.queue)

    def reclaim_stale(self) -> list[Reservation]:
        """Drop reservations whose holder has gone; return them."""
        with self._store.view() as st:
            return list(st.reclaimed)

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready view: per GPU units free/held with reservation ids, reservations, waiters."""
        with self._store.view() as st:
            reservations = list(st.reservations)
            queue = list(st.queue)
        return build_snapshot(self.gpus, reservations, queue)

    # ---- internals --------------------------------------------------------------

    def _reclaim(self, st: SlotState) -> None:
        # holder_alive looks at the process first: the (possibly slow) job probe is asked
        # only about holders whose process has gone
        st.reclaim(lambda h: holder_alive(h, self.job_alive), pid_alive)

    def _abandon(self, ticket: int) -> None:
        try:
            with self._store.locked(time.monotonic() + 5.0) as st:
                st.dequeue(ticket)
        except Exception:
            pass  # best effort: a dead waiter is dropped by the next reader anyway


def _waiter(ticket: int, req: SlotRequest, holder: Holder, model: str) -> Waiter:
    """This process's place in line for ``req``."""
    return Waiter(
        ticket=ticket, model=model, units=req.units, whole_gpus=req.whole_gpus,
        candidates=req.candidates, holder=holder,
        waiter=WaitingProcess(os.getpid(), pid_start_time(os.getpid())),
        enqueued_at=time.time(),
    )  # fmt: skip
