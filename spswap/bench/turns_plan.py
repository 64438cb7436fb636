"""The pure parts of ``spswap bench turns``: the turn plan, one turn's measurement, and
the summary of a run. No Slurm, no torch, no clock: the runner (:mod:`.turns`) feeds
them what it saw.

A run of K models and R rounds is K cold turns (each model's first start, in order) and
then R rounds of K turns; every turn displaces the model that ran before it, and every
turn after the cold ones should restore (kept or from an image).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from spswap.errors import ConfigError


class TurnKind(str, Enum):
    """What a turn is meant to show."""

    COLD = "cold"  # the model's first start: its cold answer is the reference
    RESTORE = "restore"  # a later turn: should come back kept or from its image


RESTORED_PATHS = ("kept", "image")


@dataclass(frozen=True)
class PlannedTurn:
    """One turn: ``model`` (an index into the models) starts, ``displaced`` (or None for
    the very first turn) is put away."""

    index: int
    round: int  # 0: the cold turns; 1..R: the rounds
    model: int
    displaced: int | None
    kind: TurnKind


def plan_turns(models: int, rounds: int) -> list[PlannedTurn]:
    """K cold turns, then ``rounds`` rounds of K turns, each model once per round."""
    if models < 2:
        raise ConfigError(f"bench turns needs at least 2 models to take turns; got {models}")
    if rounds < 1:
        raise ConfigError(f"--rounds must be at least 1; got {rounds}")
    turns: list[PlannedTurn] = []
    previous: int | None = None
    for rnd in range(rounds + 1):
        for m in range(models):
            turns.append(
                PlannedTurn(
                    index=len(turns),
                    round=rnd,
                    model=m,
                    displaced=previous,
                    kind=TurnKind.COLD if rnd == 0 else TurnKind.RESTORE,
                )
            )
            previous = m
    return turns


@dataclass(frozen=True)
class TurnResult:
    """What one turn measured (seconds; epoch times come in, shares go out)."""

    index: int
    round: int
    model: str
    kind: TurnKind
    path: str  # how the incoming run served: cold / pool / kept / image (runs.jsonl)
    total_s: float  # the Slurm action -> the incoming model's first answer
    slurm_s: float  # the action -> the incoming job's run started
    spswap_s: float  # the run started -> its first answer
    identical: bool  # the answer equals the model's cold answer (token ids, greedy)
    reason: str | None = None  # why a turn meant to restore did not
    # of Slurm's share: the incoming job not yet allowed to start (a requeued job may
    # start again only AuthInfo=cred_expire + 1 s after its requeue), to Slurm's second
    requeue_wait_s: float = 0.0

    @property
    def restored(self) -> bool:
        return self.path in RESTORED_PATHS


def measure_turn(turn: PlannedTurn, model: str, *, action_s: float, run_started_s: float,
                 answered_s: float, path: str, identical: bool, reason: str | None = None,
                 eligible_s: float | None = None) -> TurnResult:  # fmt: skip
    """One turn's shares from its three moments (epoch seconds). A run start before the
    action (clock steps of the tick-resolution start time) counts as 0 s of Slurm's.
    ``eligible_s``: when Slurm allowed the incoming job to start (its ``EligibleTime``);
    the part of Slurm's share before it is a restored turn's requeue wait."""
    run_started_s = min(max(run_started_s, action_s), answered_s)
    slurm_s = run_started_s - action_s
    # only a requeued job waits for the requeue delay: a first start's job was submitted
    # held and released at the action, and its EligibleTime (whole seconds) may read a
    # fraction past the action without any wait behind it
    wait_s = 0.0
    if turn.kind is TurnKind.RESTORE and eligible_s is not None:
        wait_s = min(max(eligible_s - action_s, 0.0), slurm_s)
    return TurnResult(index=turn.index, round=turn.round, model=model, kind=turn.kind,
                      path=path, total_s=answered_s - action_s, slurm_s=slurm_s,
                      spswap_s=answered_s - run_started_s, identical=identical,
                      reason=reason, requeue_wait_s=wait_s)  # fmt: skip


@dataclass
class Stats:
    """Mean and max of a set of turns (None: no such turn)."""

    count: int = 0
    mean_s: float | None = None
    max_s: float | None = None
    slurm_mean_s: float | None = None
    spswap_mean_s: float | None = None
    spswap_max_s: float | None = None

    @classmethod
    def of(cls, turns: list[TurnResult]) -> Stats:
        if not turns:
            return cls()
        return cls(count=len(turns), mean_s=statistics.fmean(t.total_s for t in turns),
                   max_s=max(t.total_s for t in turns),
                   slurm_mean_s=statistics.fmean(t.slurm_s for t in turns),
                   spswap_mean_s=statistics.fmean(t.spswap_s for t in turns),
                   spswap_max_s=max(t.spswap_s for t in turns))  # fmt: skip


@dataclass
class TurnsSummary:
    """A whole run: every turn, the stats per model and over the restored turns, and the
    device time against K dedicated devices."""

    models: list[str]
    turns: list[TurnResult]
    cold: Stats = field(default_factory=Stats)
    restored: Stats = field(default_factory=Stats)
    per_model: dict[str, dict[str, Stats]] = field(default_factory=dict)
    speedup: float | None = None  # mean cold turn / mean restored turn
    identical: int = 0  # answers equal to cold, over every turn after the cold ones
    compared: int = 0
    not_restored: int = 0  # turns meant to restore that came up another way
    restored_paths: tuple[str, ...] = RESTORED_PATHS  # the paths counted as restored
    device_s: float = 0.0  # one device, first action -> last answer
    dedicated_device_s: float = 0.0  # K devices over the same time
    settings: dict[str, Any] = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)  # slots, uses, images still there
    job_ids: dict[str, str] = field(default_factory=dict)  # model -> its Slurm job

    @property
    def ok(self) -> bool:
        """Every later answer identical, every later turn restored, nothing left over."""
        return (self.identical == self.compared and self.not_restored == 0
                and not self.leftovers)  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        # "turn" counts from 1, as the table's column does (the plan's index from 0)
        out["turns"] = [_turn_json(t) for t in self.turns]
        out["ok"] = self.ok
        return out


def _turn_json(t: TurnResult) -> dict[str, Any]:
    fields = {k: v for k, v in asdict(t).items() if k != "index"}
    return {"turn": t.index + 1, **fields, "kind": t.kind.value}


def summarize(models: list[str], turns: list[TurnResult], *, wall_s: float,
              settings: dict[str, Any] | None = None,
              leftovers: list[str] | None = None,
              job_ids: dict[str, str] | None = None,
              restored_paths: tuple[str, ...] = RESTORED_PATHS) -> TurnsSummary:  # fmt: skip
    """The run's figures from its turns; ``wall_s`` is first action -> last answer.
    ``restored_paths``: the paths that count as restored (``spswap demo`` without CRIU
    counts the pool too: there is no checkpoint to restore, by design)."""
    cold = [t for t in turns if t.kind is TurnKind.COLD]
    later = [t for t in turns if t.kind is TurnKind.RESTORE]
    restored = [t for t in later if t.path in restored_paths]
    summary = TurnsSummary(models=list(models), turns=list(turns), cold=Stats.of(cold),
                           restored=Stats.of(restored), settings=dict(settings or {}),
                           leftovers=list(leftovers or []),
                           job_ids=dict(job_ids or {}),
                           restored_paths=tuple(restored_paths))  # fmt: skip
    for name in models:
        summary.per_model[name] = {
            "cold": Stats.of([t for t in cold if t.model == name]),
            "restored": Stats.of([t for t in restored if t.model == name]),
        }
    if summary.cold.mean_s and summary.restored.mean_s:
        summary.speedup = summary.cold.mean_s / summary.restored.mean_s
    summary.compared = len(later)
    summary.identical = sum(t.identical for t in later)
    summary.not_restored = len(later) - len(restored)
    summary.device_s = wall_s
    summary.dedicated_device_s = wall_s * len(models)
    return summary
