"""The GPU slot of one serving run and how the run is told to stop: reserved once (a stop
signal ends the wait), released once. Shared by ``spswap serve``'s reference and vLLM runs."""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any

from spswap.access import release_slot, reserve_slot
from spswap.config import Config
from spswap.errors import SpswapError, StopRequested


class RunSlot:
    """A run's reservation on its job's GPUs (none when the job has no GPU list)."""

    def __init__(
        self, cfg: Config, *, model: str, units: int, gpus: tuple[int, ...],
        job_id: str | None, timeout_s: float,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.model, self.units, self.gpus = model, units, gpus
        self.job_id, self.timeout_s = job_id, timeout_s
        self.reservation: Any = None
        self._waiting = False

    def interrupt(self, signal_name: str) -> None:
        """From a signal handler: end a wait for the slot (nothing has started yet). A
        reservation granted at that very moment is held by this process until it exits
        (then reclaimed), which comes next."""
        if self._waiting:
            raise StopRequested(f"{signal_name} while waiting for the GPU slot")

    def reserve(self, stopped: str | None = None) -> None:
        """Reserve (through spswapd unless root); ``stopped``: a stop signal that came
        before, which ends the run before it asks."""
        if not self.gpus:
            return
        if stopped is not None:
            raise StopRequested(f"{stopped} before the GPU slot was asked for")

        self._waiting = True
        try:
            self.reservation = reserve_slot(
                self.cfg, model=self.model, units=self.units, allowed_gpus=self.gpus,
                job_id=self.job_id, timeout_s=self.timeout_s,
            )  # fmt: skip
        finally:
            self._waiting = False

    def release(self) -> str | None:
        """Give the reservation back (once; a no-op without one). A release that fails is
        said, not raised (the text returned): the run goes on to its checkpoint (the
        walk: root had released a stuck-looking reservation by hand, and the job's next
        stop ended in "no reservation" with no checkpoint made); a reservation left
        behind is reclaimed once its holder is gone."""
        if self.reservation is None:
            return None
        reservation, self.reservation = self.reservation, None
        try:
            release_slot(self.cfg, reservation.id)
        except (SpswapError, OSError) as e:
            return f"could not give back GPU slot {reservation.id} ({e})"
        return None


class StopSignals:
    """A run's stop request: the first signal that asked (``stop_signal``) and an event the
    serving loop waits on (``stop_event``). Handlers only record it (no work in a
    handler), except that a wait for the GPU slot ends at once (nothing started yet)."""

    def __init__(self, slot: RunSlot) -> None:
        self.slot = slot
        self.stop_event = threading.Event()
        self.stop_signal: str | None = None
        self.stopped_at = 0.0  # time.monotonic() of the first stop request

    def handle_signal(self, signum: int, _frame: FrameType | None = None) -> None:
        """Record the request (the first signal's name wins) and wake the loop."""
        if self.stop_signal is None:
            self.stop_signal = signal.Signals(signum).name
            self.stopped_at = time.monotonic()
        self.stop_event.set()
        self.slot.interrupt(self.stop_signal)

    def install_signal_handlers(self) -> None:
        """Preemption (USR1), SIGTERM and SIGINT ask the run to stop."""
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.handle_signal)

    def clear_stop(self) -> None:
        """Restored into a later run: the stop that parked it is behind it."""
        self.stop_signal = None
        self.stop_event.clear()
