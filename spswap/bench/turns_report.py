"""``spswap bench turns``'s table: one row per turn, then the figures per model and over
the restored turns (pure: a summary in, a rich renderable out)."""

from __future__ import annotations

from collections import Counter

from rich.console import Group
from rich.table import Table
from rich.text import Text

from spswap.bench.turns_plan import Stats, TurnKind, TurnResult, TurnsSummary


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def turn_line(t: TurnResult) -> str:
    """A turn's line in the bench's progress log."""
    waited = f" of which requeue wait {t.requeue_wait_s:.2f}" if t.requeue_wait_s else ""
    return (f"bench turns: turn {t.index + 1} round {t.round} {t.model}: {t.path} "
            f"{t.total_s:.2f} s (Slurm {t.slurm_s:.2f}{waited}, spswap {t.spswap_s:.2f})"
            + ("" if t.identical else " ANSWER DIFFERS"))  # fmt: skip


def _name_width(summary: TurnsSummary) -> int:
    return max((len(m) for m in summary.per_model), default=5)


SECONDS_COLUMNS = ("total", "Slurm", "wait", "spswap")


def turn_table(summary: TurnsSummary) -> Table:
    """Every turn: the path it came up by and its time, split into Slurm's and spswap's
    (and, where a turn waited for Slurm's requeue delay, that part of Slurm's share).
    The turns' reasons are not in it (:func:`turn_reasons` says them under it)."""
    waited = any(t.requeue_wait_s > 0 for t in summary.turns)
    title = "spswap bench turns: every turn, action -> first answer (seconds" + (
        "; wait: the part of Slurm's that was its requeue delay)" if waited else ")"
    )
    table = Table(title=title)
    # one-word headers, the unit in the title: at 80 columns (what a pipe or a log gets)
    # the table keeps every value whole
    for col in ("turn", "round", "model", "path", "total", "Slurm",
                *(("wait",) if waited else ()), "spswap", "answer"):  # fmt: skip
        # a model's name is never cut (at 80 columns "small-…" hid which model it was);
        # the other cells fold where they must
        table.add_column(col, justify="right" if col in SECONDS_COLUMNS else "left",
                         overflow="fold", min_width=_name_width(summary) if col == "model"
                         else None)  # fmt: skip
    for t in summary.turns:
        answer = "reference" if t.kind.value == "cold" else \
            "identical" if t.identical else "DIFFERS"  # fmt: skip
        wait = (_s(t.requeue_wait_s),) if waited else ()
        table.add_row(str(t.index + 1), str(t.round), t.model, t.path, _s(t.total_s),
                      _s(t.slurm_s), *wait, _s(t.spswap_s), answer)  # fmt: skip
    return table


def turn_reasons(turns: list[TurnResult]) -> Text | None:
    """The reasons of the turns that have one, a line each under the turn table (in the
    table's path column they squeezed every other column at 80 columns)."""
    lines = [f"turn {t.index + 1} ({t.model}, {t.path}): {t.reason}" for t in turns if t.reason]
    return Text("\n".join(lines)) if lines else None


def _stats_row(table: Table, what: str, cold: Stats, restored: Stats) -> None:
    ratio = f"{cold.mean_s / restored.mean_s:.1f}x" if cold.mean_s and restored.mean_s else "-"
    table.add_row(what, _s(cold.mean_s), str(restored.count), _s(restored.mean_s),
                  _s(restored.max_s), _s(restored.slurm_mean_s), _s(restored.spswap_mean_s),
                  _s(restored.spswap_max_s), ratio)  # fmt: skip


# Headers narrow enough for 80 columns (what a pipe or a log gets): "turns" counts the
# restored turns, "faster" is cold mean / restored mean, two-word headers on two lines.
STATS_COLUMNS = ("model", "cold", "turns", "mean", "max", "Slurm\nmean", "spswap\nmean",
                 "spswap\nmax", "faster")  # fmt: skip
STATS_TITLE = "restored turns against cold starts (s; faster = cold mean / restored mean)"


def stats_table(summary: TurnsSummary) -> Table:
    """Per model and over all restored turns: mean/max, the shares, the ratio to cold;
    every value whole at 80 columns."""
    table = Table(title=STATS_TITLE)
    for col in STATS_COLUMNS:
        table.add_column(col, justify="left" if col == "model" else "right", overflow="fold",
                         min_width=_name_width(summary) if col == "model" else None)  # fmt: skip
    for name, stats in summary.per_model.items():
        _stats_row(table, name, stats["cold"], stats["restored"])
    _stats_row(table, "all", summary.cold, summary.restored)
    return table


PATH_WORDS = {"kept": "kept", "image": "from the image", "pool": "from the pool"}


def _paths_text(paths: tuple[str, ...]) -> str:
    """``('kept', 'image')`` as ``kept or from the image``: how a turn counts as restored."""
    said = [PATH_WORDS.get(p, p) for p in paths]
    return " or ".join(said) if len(said) < 3 else ", ".join(said[:-1]) + " or " + said[-1]


def came_back_text(summary: TurnsSummary) -> str:
    """How the later turns came back, by the paths they took: ``6 of 6 later turns came
    back (4 kept, 2 from the image)``; with none restored, the paths that would count."""
    later = [t for t in summary.turns if t.kind is TurnKind.RESTORE]
    counts = Counter(t.path for t in later if t.path in summary.restored_paths)
    head = f"{summary.compared - summary.not_restored} of {summary.compared} later turns came back"
    if not counts:
        return f"{head} {_paths_text(summary.restored_paths)}"
    split = ", ".join(f"{counts[p]} {PATH_WORDS.get(p, p)}" for p in summary.restored_paths
                      if counts[p])  # fmt: skip
    return f"{head} ({split})"


def verdict(summary: TurnsSummary) -> Text:
    """One line a user can act on: what held and what did not."""
    parts = [
        f"{summary.identical} of {summary.compared} answers identical to cold",
        came_back_text(summary),
        f"after the cold starts the rounds held one device {summary.device_s:.0f} s, against "
        f"{summary.dedicated_device_s:.0f} device-seconds for {len(summary.models)} "
        "dedicated devices (one per model, held as long)",
    ]
    waits = [t.requeue_wait_s for t in summary.turns if t.requeue_wait_s > 0]
    if waits:
        parts.append(f"{len(waits)} turn(s) waited {sum(waits):.2f} s in all for Slurm's "
                     "requeue delay (a requeued job may start again only "
                     "AuthInfo=cred_expire + 1 s after its requeue: lower cred_expire, 5 at "
                     "least, to shorten it; a preempted job that comes back after the "
                     "preemptor's work does not wait)")  # fmt: skip
    if summary.leftovers:
        parts.append("left over: " + "; ".join(summary.leftovers))
    style = "green" if summary.ok else "red"
    return Text(("ok: " if summary.ok else "NOT ok: ") + ", ".join(parts), style=style)


def render_turns(summary: TurnsSummary) -> Group:
    """The whole report: the turns (their reasons under the table, where they squeezed
    every other column at 80 columns), the stats, the verdict, the settings."""
    settings = ", ".join(f"{k}={v}" for k, v in sorted(summary.settings.items())
                         if k != "work_dir")  # fmt: skip
    parts: list[Table | Text] = [turn_table(summary)]
    reasons = turn_reasons(summary.turns)
    if reasons:
        parts.append(reasons)
    parts += [stats_table(summary), verdict(summary)]
    if "work_dir" in summary.settings:
        parts.append(Text(f"models, job scripts and logs: {summary.settings['work_dir']} "
                          "(remove it when done)"))  # fmt: skip
    return Group(*parts, Text(settings, style="dim"))
