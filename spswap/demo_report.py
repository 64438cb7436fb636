"""The pure parts of ``spswap demo``: which path the demo can show on this machine, why a
turn came out slower than its model's cold start, and the report (the turn table of
``spswap bench turns`` with the demo's own notes). No torch, no processes, no clock.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rich.console import Group
from rich.text import Text

from spswap.bench.turns_plan import RESTORED_PATHS, TurnKind, TurnResult, TurnsSummary
from spswap.bench.turns_report import stats_table, turn_reasons, turn_table, verdict
from spswap.checkpoint.criu_find import missing_text

CRIU_HINT = "bash scripts/build_criu.sh"


@dataclass(frozen=True)
class DemoMode:
    """How the demo's turns are put away: ``criu`` (spswapd dumps each displaced server,
    kept alive or to an image) or ``pool`` (each stop ends the server; the next run
    starts a new one whose weights come from the pool). ``note``: why not CRIU, and what
    to run to get it."""

    checkpoint: bool
    note: str | None = None

    @property
    def name(self) -> str:
        return "criu" if self.checkpoint else "pool"

    @property
    def restored_paths(self) -> tuple[str, ...]:
        # without CRIU there is no image to restore: the pool is the path being shown
        return RESTORED_PATHS if self.checkpoint else ("pool",)


def choose_mode(euid: int, criu_path: str | None, criu_version: tuple[int, int, int] | None,
                min_version: tuple[int, int, int] = (4, 1, 0),
                criu_setting: str = "") -> DemoMode:  # fmt: skip
    """CRIU where the demo runs as root and a CRIU >= ``min_version`` is found; the pool
    otherwise, saying why and what to run (``criu_setting``: SPSWAP_CRIU, where set)."""
    want = ".".join(map(str, min_version[:2]))
    if criu_path is None and criu_setting:
        return DemoMode(False, "the turns go through the pool alone: "
                        f"{missing_text(criu_setting)}")  # fmt: skip
    if criu_path is None:
        return DemoMode(False, f"no CRIU found: the turns go through the pool alone. For the "
                        f"checkpoint path, build CRIU >= {want} as root (`{CRIU_HINT}`) and "
                        "run the demo as root")  # fmt: skip
    if criu_version is None or criu_version < min_version:
        have = ".".join(map(str, criu_version)) if criu_version else "unknown"
        return DemoMode(False, f"{criu_path} is CRIU {have}, need >= {want}: the turns go "
                        f"through the pool alone. Run `{CRIU_HINT}` as root for the "
                        "checkpoint path")  # fmt: skip
    if euid != 0:
        return DemoMode(False, "not root: spswapd's CRIU dumps need root, so the turns go "
                        "through the pool alone. Run the demo as root (e.g. `sudo "
                        ".venv/bin/spswap demo`) for the checkpoint path")  # fmt: skip
    return DemoMode(True)


def explain_slower(turns: list[TurnResult], mode: DemoMode, *, cores: int | None = None,
                   load: float | None = None) -> list[TurnResult]:  # fmt: skip
    """Every later turn slower than its model's cold turn gets a reason: a row may show
    spswap slower than no spswap, never without saying why. ``cores`` and ``load`` (the
    machine's 1-minute load average when the run ended) back the reason that is left
    when the turn's own figures do not explain it."""
    cold = {t.model: t for t in turns if t.kind is TurnKind.COLD}
    out = []
    for t in turns:
        ref = cold.get(t.model)
        if t.kind is TurnKind.COLD or ref is None or t.total_s <= ref.total_s or t.reason:
            out.append(t)
            continue
        if not mode.checkpoint:
            why = "pool path: a new process each turn, which imports torch again"
        elif t.slurm_s > ref.slurm_s and t.slurm_s >= t.spswap_s:
            why = (
                f"the displaced model's dump took {t.slurm_s:.2f} s of it "
                f"(Slurm's share of the cold turn: {ref.slurm_s:.2f} s)"
            )
        else:
            busy = (f"load average {load:.1f} on {cores} cores" if load is not None and cores
                    else "a busy machine?")  # fmt: skip
            why = (
                f"spswap's share {t.spswap_s:.2f} s against {ref.spswap_s:.2f} s cold, "
                f"not explained by the turn's own figures ({busy})"
            )
        out.append(dataclasses.replace(t, reason=f"slower than cold: {why}"))
    return out


def demo_ok(summary: TurnsSummary) -> bool:
    """The demo's exit status: every later answer equals its model's cold answer."""
    return summary.identical == summary.compared


CPU_MEMORY_SPEED_GB_S = 5.0  # a copy between two resident buffers on the 2-core CI box


def pool_copy_note(slowest_gb_per_s: object, device: str) -> str | None:
    """What the slowest start from the pool says. On the CPU the engine's weights are the
    pool's own tmpfs pages, mapped with every page present (no copy, no page faults
    later): that runs at memory speed or faster, and slower only on a machine short of
    memory or CPU; None when no start came from the pool."""
    if not isinstance(slowest_gb_per_s, (int, float)):
        return None
    rate = f"{slowest_gb_per_s:.1f} GB/s"
    if device != "cpu":
        return f"starts from the pool: the slowest copied the weights at {rate}"
    text = (f"starts from the pool: the slowest mapped the weights at {rate} (on the CPU "
            "the weights are the pool's own pages, not a copy)")  # fmt: skip
    if slowest_gb_per_s >= CPU_MEMORY_SPEED_GB_S:
        return text
    return (
        f"{text}, below memory speed ({CPU_MEMORY_SPEED_GB_S:g} GB/s on CPU): the machine "
        "was short of memory or CPU while it mapped them (`free -g`, `uptime`); `spswap "
        "bench transfer --device cpu` sets a plain copy on this machine beside it"
    )


def render_demo(summary: TurnsSummary, mode: DemoMode) -> Group:
    """The turn table and the stats of ``spswap bench turns``, then the demo's notes;
    every value whole at 80 columns, the turns' reasons below."""
    table = turn_table(summary)
    table.title = (f"spswap demo: {len(summary.models)} models take turns on "
                   f"{summary.settings.get('device', '?')}, through "
                   f"{'CRIU (spswapd)' if mode.checkpoint else 'the pool'} (seconds)")  # fmt: skip
    parts: list[Any] = [table]
    reasons = turn_reasons(summary.turns)
    if reasons:
        parts.append(reasons)
    parts += [stats_table(summary), verdict(summary)]
    if not demo_ok(summary):
        parts.append(Text("Some answers differ from the cold answers: the swap path is "
                          "broken.", style="bold red"))  # fmt: skip
    if mode.note:
        parts.append(Text(mode.note, style="yellow"))
    copy_note = pool_copy_note(summary.settings.get("pool_copy_gb_per_s_min"),
                               str(summary.settings.get("device", "")))  # fmt: skip
    if copy_note:
        parts.append(Text(copy_note, style="yellow" if "below" in copy_note else "dim"))
    parts.append(
        Text(
            "total = the demo stops the running model (Slurm's share: its stop, and the dump "
            "where CRIU is used, until the next run's `spswap serve` starts) -> the incoming "
            "model's first answer (spswap's share). Each model's first turn is its cold start "
            "(weights from its files); its answer is the reference. "
            + ", ".join(f"{k}={v}" for k, v in sorted(summary.settings.items())),
            style="dim",
        )
    )
    parts.append(Text("Next: docs/slurm.md, \"Try it on one machine\": the same swap for a "
                      "normal user's job, preempted under a test Slurm."))  # fmt: skip
    return Group(*parts)


def demo_json(summary: TurnsSummary, mode: DemoMode) -> dict[str, Any]:
    """``spswap demo --json``: the bench's summary plus the demo's mode and verdict."""
    out = summary.to_json()
    out.update(mode=mode.name, note=mode.note, all_equal=demo_ok(summary))
    return out
