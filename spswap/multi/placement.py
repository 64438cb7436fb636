"""Which models of a multi-model job are awake: pure bookkeeping (no torch, no processes).

The router asks :meth:`Placement.plan_wake` before it serves a model: an awake model
needs nothing; an asleep one needs a free awake slot, made by putting the least recently
used idle awake model to sleep. A model that is answering is *busy* and never chosen, so
a swap never cuts a running request (it waits for it). :func:`budget_refusal` is the
start-time check that a set of models can meet a latency target at all.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from spswap.errors import ConfigError

UNITS_PER_DEVICE = 4  # the slot table's quarter-GPU units
DEFAULT_UNITS_PER_MODEL = 2  # two awake at about half the device each


class ModelState(str, enum.Enum):
    AWAKE = "awake"
    ASLEEP = "asleep"


class SwapCause(str, enum.Enum):
    """Why a model was put to sleep (the metrics' ``cause`` label)."""

    DEMAND = "demand"  # another model's request needed its awake slot
    IDLE = "idle"  # no request for idle_timeout_s


def awake_slots(n_models: int, units_per_model: int = DEFAULT_UNITS_PER_MODEL,
                devices: int = 1, max_awake: int | None = None) -> int:  # fmt: skip
    """How many models fit awake at once: whole models of ``units_per_model`` quarter
    units on ``devices`` devices, at most ``max_awake`` and at most ``n_models``."""
    if not 1 <= units_per_model <= UNITS_PER_DEVICE:
        raise ConfigError(f"--units {units_per_model}: give 1 to {UNITS_PER_DEVICE} quarter "
                          "units of a device per awake model")  # fmt: skip
    fit = devices * (UNITS_PER_DEVICE // units_per_model)
    if max_awake is not None:
        if max_awake < 1:
            raise ConfigError(f"--awake {max_awake}: at least one model must be awake")
        fit = min(fit, max_awake)
    return max(1, min(fit, n_models))


def budget_refusal(n_models: int, slots: int, latency_target_s: float | None,
                   swap_s: float) -> str | None:  # fmt: skip
    """Why ``n_models`` cannot meet ``latency_target_s`` with ``slots`` awake and a swap
    of ``swap_s`` (Nodus's budget: models <= awake slots + target / swap time); None when
    they can, or when no target was given."""
    if latency_target_s is None:
        return None
    if latency_target_s <= 0:
        return f"--latency-target-s {latency_target_s:g}: give a positive number of seconds"
    extra = math.inf if swap_s <= 0 else math.floor(latency_target_s / swap_s)
    allowed = slots + extra
    if n_models <= allowed:
        return None
    return (f"{n_models} models cannot meet --latency-target-s {latency_target_s:g}: with "
            f"{slots} awake and a swap of {swap_s:.3f} s at most {int(allowed)} fit the "
            f"target; serve fewer models, raise --latency-target-s, or allow more awake "
            f"(--units / --awake)")  # fmt: skip


@dataclass(frozen=True)
class WakePlan:
    """What must happen before a model can answer: models to put to sleep, then whether
    to wake it. ``blocked``: no awake slot can be freed now (every awake model is busy)."""

    sleep: tuple[str, ...] = ()
    wake: bool = False
    blocked: bool = False


@dataclass
class Placement:
    """The awake/asleep state of each model, its last use and whether it is answering."""

    names: tuple[str, ...]
    slots: int
    states: dict[str, ModelState] = field(default_factory=dict)
    last_used_s: dict[str, float] = field(default_factory=dict)
    busy: set[str] = field(default_factory=set)
    swapping: set[str] = field(default_factory=set)  # being put to sleep right now

    def __post_init__(self) -> None:
        if len(set(self.names)) != len(self.names):
            raise ConfigError(f"models named twice in {list(self.names)}: each model directory "
                              "needs its own name")  # fmt: skip
        for i, name in enumerate(self.names):
            self.states.setdefault(name, ModelState.AWAKE if i < self.slots else ModelState.ASLEEP)
            self.last_used_s.setdefault(name, 0.0)

    def awake(self) -> list[str]:
        return [n for n in self.names if self.states[n] is ModelState.AWAKE]

    def plan_wake(self, name: str) -> WakePlan:
        """What serving ``name`` needs now (see :class:`WakePlan`)."""
        if name in self.swapping:  # its sleep must end before it can wake
            return WakePlan(blocked=True)
        if self.states[name] is ModelState.AWAKE:
            return WakePlan()
        awake = self.awake()
        if len(awake) < self.slots:
            return WakePlan(wake=True)
        idle = [n for n in awake if n not in self.busy and n not in self.swapping]
        if not idle:
            return WakePlan(blocked=True)
        victim = min(idle, key=lambda n: (self.last_used_s[n], self.names.index(n)))
        return WakePlan(sleep=(victim,), wake=True)

    def resize(self, slots: int) -> list[str]:
        """At most ``slots`` awake from now on: the least recently used awake models
        beyond count as asleep (returned: the caller puts them to sleep). Call it with
        no model answering (a busy one is never put to sleep)."""
        if slots < 1:
            raise ConfigError(f"--awake {slots}: at least one model must be awake")
        self.slots = min(slots, len(self.names))
        awake = sorted(self.awake(), key=lambda n: (self.last_used_s[n], self.names.index(n)))
        victims = [n for n in awake if n not in self.busy][: max(0, len(awake) - self.slots)]
        for name in victims:
            self.states[name] = ModelState.ASLEEP
        return victims

    def touch_all(self, now_s: float) -> None:
        """Every model counts as used at ``now_s``: at the start (a model nobody asked yet
        is idle from then, not since the clock's zero) and after a restore (the stop's
        time is nobody's idleness)."""
        for name in self.names:
            self.last_used_s[name] = now_s

    def idle_too_long(self, now_s: float, idle_timeout_s: float | None) -> list[str]:
        """Awake, not answering, and unused for ``idle_timeout_s``: to be put to sleep."""
        if idle_timeout_s is None:
            return []
        return [
            n
            for n in self.awake()
            if n not in self.busy and now_s - self.last_used_s[n] >= idle_timeout_s
        ]

    def begin_swap(self, name: str, plan: WakePlan, now_s: float) -> None:
        """``plan`` is being carried out for ``name``: the victims count as asleep (a
        request for one plans a wake) but are held (never chosen, never woken) until
        :meth:`end_swap`; ``name`` counts as awake and is busy."""
        for victim in plan.sleep:
            self.states[victim] = ModelState.ASLEEP
            self.swapping.add(victim)
        if plan.wake:
            self.states[name] = ModelState.AWAKE
        self.begin(name, now_s)

    def end_swap(self, victims: tuple[str, ...]) -> None:
        self.swapping.difference_update(victims)

    def mark(self, name: str, state: ModelState) -> None:
        self.states[name] = state

    def begin(self, name: str, now_s: float) -> None:
        """``name`` starts answering: busy (never a victim) and most recently used."""
        self.busy.add(name)
        self.last_used_s[name] = now_s

    def end(self, name: str, now_s: float) -> None:
        self.busy.discard(name)
        self.last_used_s[name] = now_s
