"""The node's GPU slot table: who holds which quarter of which GPU, and who waits.

Each GPU is divided into :data:`UNITS_PER_GPU` units. A reservation takes 1, 2 or 4
units of one GPU (buddy style: a pair of units starts at an even index, so 2+2 and
1+1+2 pack into one GPU) or N whole GPUs. The state is one versioned JSON file,
replaced atomically, and every read or change happens under one file lock that is
never unlinked (unlinking a locked file splits waiters across inodes).

Waiters queue with a ticket and are served first come, first served: a request is
granted only when no earlier waiter that could use one of the same GPUs is still
waiting. Reservations whose holder has gone (process dead, Slurm job ended) and
waiters whose process has gone are dropped on every locked read.

No torch, CUDA, NVML or Slurm here: the GPU list and the job probe come from outside.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import filelock

from spswap.config import Config
from spswap.errors import PermissionDenied, SlotError, SlotTimeout, SpswapError
from spswap.fsutil import STATE_VERSION, atomic_write_json, close_mode, read_json
from spswap.liveness import Holder, JobProbe, holder_alive, pid_alive, pid_start_time
from spswap.slots.alloc import UNITS_PER_GPU, VALID_UNITS, allocate

STATE_FILE = "state.json"
LOCK_FILE = "slots.lock"
_READ_LOCK_TIMEOUT_S = 30.0
# Only the daemon (root) writes here: a lock users could open (flock needs only a
# read-only descriptor) would let any of them hold it forever, and a writable state file
# would let them grant themselves GPUs. Users read the state without the lock.
DIR_MODE = 0o755
STATE_MODE = 0o644
LOCK_MODE = 0o600


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
class _Request:
    units: int
    whole_gpus: int | None
    candidates: tuple[int, ...]

    def describe(self) -> str:
        where = ",".join(map(str, self.candidates))
        if self.whole_gpus is not None:
            return f"{self.whole_gpus} whole GPU(s) of {where}"
        return f"{self.units} unit(s) of one GPU of {where}"


@dataclass
class _State:
    reservations: list[Reservation]
    queue: list[dict[str, Any]]
    next_ticket: int
    dirty: bool = False
    reclaimed: list[Reservation] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION, "reservations": [r.to_json() for r in self.reservations],
            "queue": self.queue, "next_ticket": self.next_ticket,
        }  # fmt: skip

    def held(self) -> dict[int, set[int]]:
        out: dict[int, set[int]] = {}
        for r in self.reservations:
            for g in r.gpus:
                out.setdefault(g, set()).update(r.units)
        return out


def _make_lock(path: Path) -> filelock.BaseFileLock:
    # preserve_lock_file (filelock >= 4) rules out the soft-lock fallback, which
    # releases by unlinking its marker; older versions never unlink on Unix.
    try:
        return filelock.FileLock(path, mode=LOCK_MODE, preserve_lock_file=True)  # type: ignore[call-arg,unused-ignore]
    except TypeError:
        return filelock.FileLock(path, mode=LOCK_MODE)


class SlotTable:
    """GPU slot reservations of one node, kept in ``slots_dir`` (node-local tmpfs)."""

    UNITS_PER_GPU = UNITS_PER_GPU

    def __init__(
        self,
        slots_dir: Path,
        gpus: Sequence[int],
        *,
        job_alive: JobProbe | None = None,
        poll_interval_s: float = 0.02,
    ) -> None:
        self.slots_dir = Path(slots_dir)
        self.gpus: tuple[int, ...] = tuple(sorted(set(int(g) for g in gpus)))
        self.job_alive = job_alive
        self.poll_interval_s = poll_interval_s
        self.state_path = self.slots_dir / STATE_FILE
        self.lock_path = self.slots_dir / LOCK_FILE
        if not self.slots_dir.is_dir():
            try:
                self.slots_dir.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
                os.chmod(self.slots_dir, DIR_MODE)  # whatever the umask
            except PermissionError:
                pass  # a user looking before the daemon made it: reads see an empty table
        self._tighten_modes()
        self._lock = _make_lock(self.lock_path)

    def _tighten_modes(self) -> None:
        # Earlier releases made these world-writable; whoever owns them (root in
        # production) takes write access away from everyone else on sight.
        for path, mode in ((self.slots_dir, DIR_MODE), (self.state_path, STATE_MODE),
                           (self.lock_path, LOCK_MODE)):  # fmt: skip
            try:
                close_mode(path, mode)
            except OSError:
                pass

    @property
    def read_only(self) -> bool:
        """True when this process cannot take the lock (a user: changes go through spswapd)."""
        target = self.lock_path if self.lock_path.exists() else self.slots_dir
        return not os.access(target, os.W_OK)

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise PermissionDenied(
                f"cannot {what} directly: {self.slots_dir} is writable only by root (uid "
                f"{os.getuid()} here); go through the daemon (spswap.access.reserve_slot / "
                "release_slot), and start it with `spswap daemon start` if it is not running"
            )

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        *,
        gpus: Sequence[int] | None = None,
        job_alive: JobProbe | None = None,
    ) -> SlotTable:
        """The table under ``cfg.paths.slots``; GPUs default to :func:`discover_gpus`."""
        if gpus is None:
            from spswap.slots.gpus import discover_gpus

            gpus = [g.index for g in discover_gpus(cfg)]
        return cls(
            cfg.paths.slots, gpus, job_alive=job_alive, poll_interval_s=cfg.slot_poll_interval_s
        )

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
        req = self._request(units, whole_gpus, allowed_gpus)
        self._check_writable("reserve a slot")
        holder = Holder.current() if holder is None else holder
        deadline = time.monotonic() + timeout_s
        ticket: int | None = None
        queued = False
        try:
            while True:
                blockers: list[Reservation] | None = None
                with self._locked(deadline) as st:
                    if ticket is None:
                        ticket = st.next_ticket
                        st.next_ticket += 1
                        st.dirty = True
                    granted = self._try_grant(st, ticket, req, holder, model)
                    if granted is not None:
                        queued = False
                        return granted
                    if time.monotonic() >= deadline:
                        self._dequeue(st, ticket)
                        queued = False
                        blockers = [r for r in st.reservations if set(r.gpus) & set(req.candidates)]
                        ahead = self._waiters_ahead(st, ticket, req)
                    else:
                        self._enqueue(st, ticket, req, holder, model)
                        queued = True
                if blockers is not None:
                    raise self._timeout_error(req, model, timeout_s, blockers, ahead)
                time.sleep(self.poll_interval_s)
        except BaseException:
            if queued and ticket is not None:
                self._abandon(ticket)
            raise

    def release(self, reservation_id: str, *, uid: int | None = None) -> Reservation:
        """Give a reservation back; ``uid`` (unless root) must be the holder's."""
        self._check_writable("release a reservation")
        with self._locked() as st:
            for r in st.reclaimed:
                if r.id == reservation_id:
                    return r  # its holder had already gone: released either way
            for r in st.reservations:
                if r.id == reservation_id:
                    if uid is not None and uid != 0 and uid != r.holder.uid:
                        raise PermissionDenied(
                            f"reservation {r.id} belongs to uid {r.holder.uid}, not to uid {uid}; "
                            "ask its owner or root to release it"
                        )
                    st.reservations.remove(r)
                    st.dirty = True
                    return r
            current = ", ".join(r.id for r in st.reservations) or "none"
        raise SlotError(
            f"no reservation {reservation_id!r} (it may have been reclaimed after its holder "
            f"ended); current reservations: {current}; see `spswap slots ls`"
        )

    def reservations(self) -> list[Reservation]:
        """Live reservations (stale ones are reclaimed first)."""
        with self._view() as st:
            return list(st.reservations)

    def waiters(self) -> list[dict[str, Any]]:
        """Queued requests in ticket order (dead waiters dropped first)."""
        with self._view() as st:
            return [dict(q) for q in st.queue]

    def reclaim_stale(self) -> list[Reservation]:
        """Drop reservations whose holder has gone; return them."""
        with self._view() as st:
            return list(st.reclaimed)

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready view: per GPU units free/held with reservation ids, reservations, waiters."""
        with self._view() as st:
            reservations = list(st.reservations)
            queue = [dict(q) for q in st.queue]
        return build_snapshot(self.gpus, reservations, queue)

    # ---- internals --------------------------------------------------------------

    def _request(
        self, units: int, whole_gpus: int | None, allowed_gpus: Sequence[int] | None
    ) -> _Request:
        if not self.gpus:
            raise SlotError(
                "no GPUs known on this node: NVML found none and CUDA_VISIBLE_DEVICES is unset; "
                "set SPSWAP_GPUS (e.g. SPSWAP_GPUS=0,1,2,3)"
            )
        valid_gpus = ", ".join(map(str, self.gpus))
        if allowed_gpus is None:
            candidates = self.gpus
        else:
            candidates = tuple(sorted(set(int(g) for g in allowed_gpus)))
            unknown = [g for g in candidates if g not in self.gpus]
            if unknown or not candidates:
                raise SlotError(
                    f"GPU(s) {unknown or '(none)'} are not on this node; valid GPUs: {valid_gpus}"
                )
        if whole_gpus is not None:
            if units != UNITS_PER_GPU:
                raise SlotError(
                    f"give either units ({units}) or whole_gpus ({whole_gpus}), not both"
                )
            if not 1 <= whole_gpus <= len(candidates):
                raise SlotError(
                    f"whole_gpus must be 1..{len(candidates)} "
                    f"(GPUs {', '.join(map(str, candidates))}), got {whole_gpus}"
                )
            return _Request(UNITS_PER_GPU, whole_gpus, candidates)
        if units not in VALID_UNITS:
            raise SlotError(
                f"units must be one of {', '.join(map(str, VALID_UNITS))} (a quarter, half or "
                f"whole GPU), got {units}; for more than one GPU use whole_gpus (--gpus N)"
            )
        return _Request(units, None, candidates)

    @contextmanager
    def _locked(self, deadline: float | None = None) -> Iterator[_State]:
        """Hold the lock, load the state, reclaim stale entries; save if changed."""
        if deadline is None:
            timeout_s = _READ_LOCK_TIMEOUT_S
        else:
            timeout_s = max(deadline - time.monotonic(), 0.0)
        try:
            # A held lock is only ever held for one read-modify-write; waiting for the
            # queue happens outside it, so a short poll is enough.
            self._lock.acquire(timeout=max(timeout_s, 1.0), poll_interval=0.001)
        except filelock.Timeout:
            raise SlotTimeout(
                f"could not take the slot lock {self.lock_path} in {max(timeout_s, 1.0):.1f} s; "
                f"a process holds it without letting go (find it with `fuser {self.lock_path}`)",
                holders=[],
            ) from None
        try:
            st = self._load()
            self._reclaim(st)
            yield st
            if st.dirty:
                atomic_write_json(self.state_path, st.to_json(), mode=STATE_MODE)
        finally:
            self._lock.release()

    @contextmanager
    def _view(self) -> Iterator[_State]:
        """The state for reading: locked (and cleaned) when this process may write it,
        else read without the lock (the file is replaced atomically) and cleaned in memory."""
        if not self.read_only:
            with self._locked() as st:
                yield st
            return
        st = self._load()
        self._reclaim(st)
        yield st

    def _load(self) -> _State:
        data = read_json(self.state_path)
        if data is None:
            return _State([], [], 1)
        if data.get("version") != STATE_VERSION:
            raise SpswapError(
                f"{self.state_path} has version {data.get('version')!r}, this spswap reads "
                f"version {STATE_VERSION}; upgrade spswap or move the file aside"
            )
        return _State(
            [Reservation.from_json(r) for r in data.get("reservations", [])],
            list(data.get("queue", [])),
            int(data.get("next_ticket", 1)),
        )

    def _alive(self, holder: Holder) -> bool:
        # holder_alive looks at the process first: the (possibly slow) job probe is asked
        # only about holders whose process has gone
        return holder_alive(holder, self.job_alive)

    def _reclaim(self, st: _State) -> None:
        live = [r for r in st.reservations if self._alive(r.holder)]
        if len(live) != len(st.reservations):
            st.reclaimed = [r for r in st.reservations if r not in live]
            st.reservations = live
            st.dirty = True
        # a place in line lives as long as the process that waits in it (the holder may be
        # a shell that outlives a killed `spswap slots reserve`)
        queue = [q for q in st.queue
                 if pid_alive((w := q.get("waiter") or q["holder"])["pid"], w.get("pid_start"))]
        if len(queue) != len(st.queue):
            st.queue = queue
            st.dirty = True

    @staticmethod
    def _waiters_ahead(st: _State, ticket: int, req: _Request) -> list[dict[str, Any]]:
        cands = set(req.candidates)
        return [q for q in st.queue if q["ticket"] < ticket and cands & set(q["candidates"])]

    def _try_grant(
        self, st: _State, ticket: int, req: _Request, holder: Holder, model: str
    ) -> Reservation | None:
        if self._waiters_ahead(st, ticket, req):
            return None
        placed = allocate(st.held(), req.candidates, units=req.units, whole_gpus=req.whole_gpus)
        if placed is None:
            return None
        gpus, units = placed
        r = Reservation(f"r{ticket}", gpus, units, holder, model, time.time())
        st.reservations.append(r)
        self._dequeue(st, ticket)
        st.dirty = True
        return r

    @staticmethod
    def _enqueue(st: _State, ticket: int, req: _Request, holder: Holder, model: str) -> None:
        if any(q["ticket"] == ticket for q in st.queue):
            return
        # Re-adding keeps the original ticket, so a state file moved aside mid-wait
        # does not cost this waiter its place.
        st.queue.append({
            "ticket": ticket, "model": model, "units": req.units, "whole_gpus": req.whole_gpus,
            "candidates": list(req.candidates), "holder": holder.to_json(),
            "waiter": {"pid": os.getpid(), "pid_start": pid_start_time(os.getpid())},
            "enqueued_at": time.time(),
        })  # fmt: skip
        st.queue.sort(key=lambda q: q["ticket"])
        st.dirty = True

    @staticmethod
    def _dequeue(st: _State, ticket: int) -> None:
        kept = [q for q in st.queue if q["ticket"] != ticket]
        if len(kept) != len(st.queue):
            st.queue = kept
            st.dirty = True

    def _abandon(self, ticket: int) -> None:
        try:
            with self._locked(time.monotonic() + 5.0) as st:
                self._dequeue(st, ticket)
        except Exception:
            pass  # best effort: a dead waiter is dropped by the next reader anyway

    def _timeout_error(
        self,
        req: _Request,
        model: str,
        timeout_s: float,
        blockers: list[Reservation],
        ahead: list[dict[str, Any]],
    ) -> SlotTimeout:
        holders = [r.describe() for r in blockers]
        lines = [f"no slot for model {model} ({req.describe()}) after {timeout_s:g} s."]
        if holders:
            lines.append("held by:")
            lines += [f"  {h}" for h in holders]
        if ahead:
            queued = ", ".join(
                f"ticket {q['ticket']} (model {q['model']}, pid {q['holder']['pid']})"
                for q in ahead
            )
            lines.append(f"{len(ahead)} earlier waiter(s) for these GPUs: {queued}")
        lines.append(
            "wait longer (--timeout-s / timeout_s) or release a reservation "
            "(`spswap slots release ID`)"
        )
        return SlotTimeout("\n".join(lines), holders=holders)


def build_snapshot(
    gpus: Sequence[int], reservations: Sequence[Reservation], queue: Sequence[dict[str, Any]]
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
        "reservations": [r.to_json() for r in reservations], "waiters": [dict(q) for q in queue],
    }  # fmt: skip
