"""The last line a run of ``spswap serve`` writes in the job's log: what this run
answered and what stopped it, or, for a run that stood in for its restored instance, only
that (the instance writes its own lines: one stop, one line that says it)."""

from __future__ import annotations

from pathlib import Path

from spswap.serve.backend import ServeResult


def stood_in_text(run: int, pid: int, *, models: bool = False) -> str:
    """The last line of a run that stood in for its restored instance (``models``: a
    multi-model job's restored models): not a second stop line, as the restored process
    writes its own.

    >>> stood_in_text(2, 42, models=True)[:60]
    "run 2 ends: it stood in for the job's restored models (pid 4"
    """
    what, it = ("the job's restored models", "they") if models else ("its restored instance", "it")
    return (f"run {run} ends: it stood in for {what} (pid {pid}), whose own lines say what "
            f"{it} did")  # fmt: skip


def models_end_text(stopped_by: str | None, answered: dict[str, int],
                    failed: dict[str, int], *, engines_ended: bool = True) -> str:  # fmt: skip
    """The last line of a multi-model job's instance: what stopped it, what its models
    answered and failed (each model's counts since the models started: a restored
    instance counts its earlier runs too) and, where they did (``engines_ended``; else
    the line before says why not), that their engines ended (exact texts:
    tests/multi/test_end_line.py).

    >>> models_end_text(None, {"a": 1}, {})
    'stopped (ended); its 1 model answered 1 request since it started (a 1), and its engine ended'
    """
    stopped = f"stopped by {stopped_by}" if stopped_by else "stopped (ended)"
    if not answered:  # (it ended before its models were up)
        return stopped
    n, total = len(answered), sum(answered.values())
    models, they, its = (f"{n} models", "they", "their engines") if n > 1 else \
        ("1 model", "it", "its engine")  # fmt: skip
    text = (f"{stopped}; its {models} answered {total} request{'s' * (total != 1)} since "
            f"{they} started ({', '.join(f'{m} {k}' for m, k in answered.items())})")  # fmt: skip
    if bad := {m: k for m, k in failed.items() if k}:
        text += (f", {sum(bad.values())} failed "
                 f"({', '.join(f'{m} {k}' for m, k in bad.items())})")  # fmt: skip
    return f"{text}, and {its} ended" if engines_ended else text


def run_end_text(result: ServeResult, state_dir: Path, *, spool: bool,
                 job_answered: int | None = None) -> str:  # fmt: skip
    """The line, without the ``spswap serve:`` prefix. ``spool``: the engine answers from
    the job's spool (reference), whose counts it gives for this run alone (a restored
    instance has answered in earlier runs too) and, in a later run, ``job_answered``:
    the answers in the job's outbox, all its runs' (an instance's own count restarts
    where a run started anew).

    >>> r = ServeResult(restart_count=1, stopped_by="SIGTERM", restored_pid=42)
    >>> run_end_text(r, Path("/s"), spool=True)
    'run 1 ends: it stood in for its restored instance (pid 42), whose own lines say what it did'
    """
    if result.restored_pid is not None and result.path is None:  # it served no engine itself
        return stood_in_text(result.restart_count, result.restored_pid)
    if any(e.get("probe") == "mismatch" for e in result.events):  # (its line said why)
        return (f"run {result.restart_count}'s restored instance ends without serving; the "
                "job's run starts anew")  # fmt: skip
    stopped = f"stopped by {result.stopped_by}" if result.stopped_by else ""
    if not spool:
        return stopped or "stopped (server ended)"
    in_run = result.answered - result.answered_before
    earlier = f" in run {result.restart_count}" if result.restart_count else ""
    if result.restart_count and job_answered is not None and job_answered != in_run:
        earlier += f", {job_answered} in all the job's runs"
    done = (f"answered {in_run}{earlier} (answers in {state_dir}/outbox), "
            f"{result.pending_left} left in {state_dir}/inbox")  # fmt: skip
    return f"{done}; {stopped}" if stopped else done
