"""The check of a restore: a restored instance answers a fixed prompt after its wake and
serves only if the answer is the one it gave before its checkpoint (greedy decoding:
the same weights and state give the same tokens). vLLM's own ``snapshot`` refuses to
serve on such a mismatch; spswap does too: a damaged pool entry (the restored process
maps it), GPU state that did not come back, a wrong GPU mapping all show here, before a
single request is answered."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

PROBE_PROMPT = (3, 1, 4, 1, 5, 9, 2, 6)  # token ids every engine and model accept
PROBE_TOKENS = 8


def tokens_text(ids: list[int] | None, shown: int = 8) -> str:
    """``[5, 9, 2, ...]``: the first token ids of a check answer."""
    if ids is None:
        return "nothing"
    return "[" + ", ".join(map(str, ids[:shown])) + (", ..." if len(ids) > shown else "") + "]"


# a restore's step names as the job's log says them (spswapd's timings keys)
_STEP_NAMES = {"verify": "image check", "thaw": "unfreeze"}


def timings_text(timings_s: Any) -> str:
    """A restore's steps for the job's log, those spswapd ran at the job's prolog (keys
    ``early_*``: restored or woken early) apart from those it ran when the run asked:
    ``{"early_criu_restore": 1.84, "thaw": 0.0039, "cuda_restore_pid12": 0.6}`` as ``at
    the job's prolog: CRIU restore 1.84 s; when this run asked: unfreeze 3.9 ms``.
    Per-process figures (``_pid``) and totals are left to ``spswap events``."""
    if not isinstance(timings_s, dict):
        return "no timings"
    early: list[str] = []
    asked: list[str] = []
    for key, value in timings_s.items():
        if (not isinstance(value, (int, float)) or isinstance(value, bool) or "_pid" in key
                or key.endswith("total")):  # fmt: skip
            continue
        name = key.removeprefix("early_")
        name = _STEP_NAMES.get(name, name).replace("_", " ")
        name = re.sub(r"\bcriu\b", "CRIU", re.sub(r"\bcuda\b", "CUDA", name))
        ms = value * 1000
        shown = f"{value:.2f} s" if ms >= 99.5 else f"{ms:.3g} ms"
        (early if key.startswith("early_") else asked).append(f"{name} {shown}")
    if not early:
        return ", ".join(asked) or "no timings"
    return "at the job's prolog: " + ", ".join(early) + (
        "; when this run asked: " + ", ".join(asked) if asked else "")  # fmt: skip


def restored_text(how: str, run: int, *, wake_s: float, check_s: float,
                  check_before_s: float | None, saved: int | None = None) -> str:  # fmt: skip
    """The restored instance's line in the job's log: how it came back, into which run,
    its wake's time and its check's (beside the same check before the checkpoint, which
    says what a restore leaves slow; ``check_before_s`` None: there was no check), and
    the saved requests it now answers (``saved``; None where the engine keeps none)."""
    checked = "" if check_before_s is None else (
        f", its check prompt answered as before in {check_s:.3f} s (it took "
        f"{check_before_s:.3f} s before its checkpoint)")  # fmt: skip
    resumed = "" if saved is None else f"; {saved} saved request(s) to resume"
    return (f"spswap serve: restored {how} into run {run}; weights back in {wake_s:.3f} s"
            f"{checked}{resumed}")  # fmt: skip


def refusal(expected: list[int] | None, probe: Callable[[], list[int] | None]) -> str | None:
    """None when ``probe()`` answers ``expected`` (or nothing was expected: no check);
    else why the restored instance must not serve, in the job log's words."""
    if expected is None:
        return None
    try:
        got = probe()
    except Exception as e:  # noqa: BLE001 - an instance that cannot answer must not serve
        problem = f"it could not answer the check prompt ({e})"
    else:
        if got == expected:
            return None
        problem = (f"it answered the check prompt with {tokens_text(got)} where it answered "
                   f"{tokens_text(expected)} before its checkpoint")  # fmt: skip
    return (f"the restored instance does not serve: {problem}: its weights or state did not "
            "come back whole; it ends, and the job's run starts cold")  # fmt: skip
