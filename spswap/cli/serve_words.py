"""The words of a ``spswap serve`` command line that are not its own options: vLLM's
options after ``--``, the further model directories of ``--models``, and what is neither
(a mistyped option, a second model without ``--models``), told as such. Pure."""

from __future__ import annotations

import difflib
from collections.abc import Sequence

# ctx.meta key: the words after `--` (the end of click's ctx.args; what comes before them
# there is a word click did not know: a mistyped option or a second model)
AFTER_DASHDASH = "spswap.serve.after_dashdash"


def before_dashdash(extra: Sequence[str], after: Sequence[str]) -> list[str]:
    """The words click did not know that stood before ``--``: ``extra`` (its leftover
    words, those after ``--`` last) less ``after`` (the words after ``--``)."""
    return list(extra[: len(extra) - len(after)])


def words_problem(
    model: str, before: Sequence[str], after: Sequence[str], *, many: bool, engine: str,
    options: Sequence[str],
) -> str | None:  # fmt: skip
    """What is wrong with the words ``serve`` did not take as its own options, or None.

    ``model``: the MODEL argument (a mistyped option may stand there); ``before`` and
    ``after``: the other words before and after ``--``; ``many``: ``--models`` was given;
    ``options``: the command's option names, for a "did you mean".

    >>> words_problem("m", ["--unit", "4"], [], many=False, engine="reference",
    ...               options=["--units", "--engine"])
    'no such option: --unit (did you mean --units?)'
    """
    for word in [model, *before]:
        if word.startswith("-") and word != "-":
            close = difflib.get_close_matches(word.split("=", 1)[0], options, n=1, cutoff=0.6)
            if close:
                return f"no such option: {word} (did you mean {close[0]}?)"
            if many:
                return (f"no such option: {word} (spswap serve --help lists them; vLLM's own "
                        "options for --models go in --vllm-args)")  # fmt: skip
            if engine == "vllm":
                return (f"no such option: {word} (spswap serve --help lists them; vLLM's own "
                        f"options go after --: spswap serve MODEL --engine vllm -- {word} "
                        "...)")  # fmt: skip
            return f"no such option: {word} (spswap serve --help lists them)"
    if before and not many:
        return (f"unexpected argument {before[0]}: spswap serve takes one MODEL (several "
                "models in one job: spswap serve --models A B C)")  # fmt: skip
    if after and many:
        return (f"unexpected arguments after --: {' '.join(after)} (vLLM's own options for "
                "--models go in --vllm-args)")  # fmt: skip
    if after and engine != "vllm":
        return (f"unexpected arguments after --: {' '.join(after)} (options after -- are "
                "vLLM's, for --engine vllm only)")  # fmt: skip
    return None
