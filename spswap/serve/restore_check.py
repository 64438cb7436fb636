"""The check of a restore: a restored instance answers a fixed prompt after its wake and
serves only if the answer is the one it gave before its checkpoint (greedy decoding:
the same weights and state give the same tokens, and the same log-probabilities where
the engine gives them). vLLM's own ``snapshot`` refuses to serve on such a mismatch;
spswap does too: a damaged pool entry (the restored process maps it), GPU state that did
not come back, a wrong GPU mapping all show here, before a single request is answered."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spswap.errors import SpswapError
from spswap.fsutil import atomic_write_json, read_json

PROBE_PROMPT = (3, 1, 4, 1, 5, 9, 2, 6)  # token ids every engine and model accept
PROBE_TOKENS = 8  # an engine that answers with tokens only
# An engine that also gives the log-probabilities of the prompt's tokens and of its own
# answers in fewer: they move with any change to the weights, where greedy tokens can
# stay; each token is a forward pass on the restore's path (26 ms for a 3B vLLM, eager).
PROBE_TOKENS_WITH_LOGPROBS = 2
# Log-probabilities are compared only where the check ran alone both times (the same GPU,
# kernels and batch: they repeat bit for bit); the margin is two roundings of a bf16
# logit of 32-64 (0.25 each), should a kernel reduce in another order, and far below
# what a damaged tensor moves (whole nats).
LOGPROB_TOLERANCE = 0.5


@dataclass(frozen=True)
class CheckAnswer:
    """An engine's answer to the check prompt: its greedy tokens and, where the engine
    gives them, the log-probabilities it computed (of the prompt's tokens after the
    first, then of its own), in that order; empty where it gives none."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] = ()
    # how long taking it took when the engine was first asked, where the engine kept the
    # answer from then (None: as long as this call took); never compared
    asked_s: float | None = field(default=None, compare=False)


def difference(before: CheckAnswer, after: CheckAnswer) -> str | None:
    """None when ``after`` is ``before`` again (tokens equal, log-probabilities within
    :data:`LOGPROB_TOLERANCE`); else how they differ, in the job log's words."""
    if after.token_ids != before.token_ids:
        return (f"it answered the check prompt with {tokens_text(list(after.token_ids))} "
                f"where it answered {tokens_text(list(before.token_ids))} before its "
                "checkpoint")  # fmt: skip
    if len(after.logprobs) != len(before.logprobs):
        return (f"it answered the check prompt with {len(after.logprobs)} log-probabilities "
                f"where it gave {len(before.logprobs)} before its checkpoint")  # fmt: skip
    gaps = [abs(a - b) for a, b in zip(after.logprobs, before.logprobs, strict=True)]
    # max() would pass over a NaN that is not first: a NaN is the worst gap
    worst = math.nan if any(map(math.isnan, gaps)) else max(gaps, default=0.0)
    if worst <= LOGPROB_TOLERANCE:  # (NaN fails this)
        return None
    shown = "not a number" if math.isnan(worst) else f"{worst:.3g}"
    return (f"it answered the check prompt with the same tokens "
            f"{tokens_text(list(after.token_ids))} but log-probabilities up to {shown} away "
            f"from those before its checkpoint (at most {LOGPROB_TOLERANCE} allowed)")  # fmt: skip


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
                  check_first_s: float | None, saved: int | None = None,
                  several: bool = False) -> str:  # fmt: skip
    """The restored instance's line in the job's log: how it came back, into which run,
    its wake's time and its check's (beside the same check when its answer was first
    taken, which says what a restore leaves slow; ``check_first_s`` None: there was no
    check), and the saved requests it now answers (``saved``; None where the engine
    keeps none); ``several``: each of the awake models answered the check (a multi-model
    job), the times theirs together."""
    what, took = ("its awake models' check prompts", "they took") if several else \
        ("its check prompt", "it took")  # fmt: skip
    checked = "" if check_first_s is None else (
        f", {what} answered as before in {check_s:.3f} s ({took} "
        f"{check_first_s:.3f} s when first asked)")  # fmt: skip
    resumed = "" if saved is None else f"; {saved} saved request(s) to resume"
    return (f"spswap serve: restored {how} into run {run}; weights back in {wake_s:.3f} s"
            f"{checked}{resumed}")  # fmt: skip


def refusal(expected: CheckAnswer | None,
            probe: Callable[[], CheckAnswer | None]) -> str | None:  # fmt: skip
    """None when ``probe()`` answers ``expected`` again (or nothing was expected: no
    check); else why the restored instance must not serve, in the job log's words."""
    if expected is None:
        return None
    try:
        got = probe()
    except Exception as e:  # noqa: BLE001 - an instance that cannot answer must not serve
        problem: str | None = f"it could not answer the check prompt ({e})"
    else:
        problem = ("it gave no answer to the check prompt" if got is None
                   else difference(expected, got))  # fmt: skip
        if problem is None:
            return None
    return (f"the restored instance does not serve: {problem}: its weights or state did not "
            "come back whole; it ends, and the job's run starts cold")  # fmt: skip


REFUSED_FILE = "restore-refused.json"  # in the job's state dir


def note_refused(state_dir: Path, restart_count: int, text: str) -> None:
    """Leave why this restored instance does not serve for the run that stands in for it
    (it sees only that its instance ended); best effort: that run then says less."""
    try:
        atomic_write_json(Path(state_dir) / REFUSED_FILE,
                          {"restart_count": restart_count, "reason": text}, mode=0o600)  # fmt: skip
    except OSError:
        pass


def refused_in(state_dir: Path, restart_count: int) -> str | None:
    """Why run ``restart_count``'s restored instance did not serve (its check failed), or
    None (no such note: it ended otherwise)."""
    try:
        raw = read_json(Path(state_dir) / REFUSED_FILE)
    except (OSError, SpswapError):
        return None
    if not isinstance(raw, dict) or raw.get("restart_count") != restart_count:
        return None
    return str(raw.get("reason"))
