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


# options that only some runs use (what the others do without them is in each line below)
VLLM_ONLY = ("--gpu-memory-utilization", "--kv-cache-gib", "--max-model-len", "--eager",
             "--no-eager", "--pack", "--no-pack", "--vllm-args")  # fmt: skip
MODELS_ONLY = ("--awake", "--idle-timeout-s", "--latency-target-s", "--swap-s")
API_ONLY = ("--port", "--host")  # the OpenAI API: vLLM's server, or the router of --models
NOT_FOR_ONE_VLLM_SERVER = ("--device", "--socket")  # it runs on the job's GPU, its own socket


def unused_options(given: Sequence[str], *, engine: str, many: bool) -> list[str]:
    """One line for each kind of option in ``given`` (the options the user gave, as
    written) that this run does not use, saying which runs use it: a job script's options
    left as they were when its engine or its models changed must not pass unnoticed.

    >>> unused_options(["--kv-cache-gib", "--units", "--awake"], engine="reference",
    ...                many=False)
    ['--kv-cache-gib ignored: for --engine vllm only', '--awake ignored: for --models only']
    """
    lines = []

    def name(flags: Sequence[str], why: str) -> None:
        if named := [flag for flag in given if flag in flags]:
            lines.append(f"{', '.join(named)} ignored: {why}")

    if engine != "vllm":
        name(VLLM_ONLY, "for --engine vllm only")
    if engine != "vllm" or many:
        name(("--launcher",), "for one model's vLLM server only (--engine vllm without "
                              "--models: with --models each model's engine runs in "
                              "spswap's own Python)")  # fmt: skip
    if not many:
        name(MODELS_ONLY, "for --models only")
        if engine != "vllm":
            name(API_ONLY, "for --engine vllm or --models only")
        else:
            name(NOT_FOR_ONE_VLLM_SERVER,
                 "for the reference engine or --models (a vLLM server runs on the job's GPU "
                 "and answers on its own socket, which STATE_DIR/endpoint.json names)")  # fmt: skip
    if (engine == "vllm" or many) and "--host" in given and "--port" not in given:
        lines.append("--host ignored: it is the address of --port's TCP endpoint (give "
                     "--port too)")  # fmt: skip
    return lines
