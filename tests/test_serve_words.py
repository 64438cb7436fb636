"""The words of a spswap serve command line that are not its options (pure)."""

from __future__ import annotations

import pytest

from spswap.cli.serve_words import before_dashdash, unused_options, words_problem

OPTS = ["--units", "--models", "--engine", "--state-dir", "--vllm-args"]


def test_before_dashdash_takes_the_words_after_it_off_the_end() -> None:
    assert before_dashdash(["b", "--x", "--max-num-seqs", "4"], ["--max-num-seqs", "4"]) == [
        "b",
        "--x",
    ]
    assert before_dashdash(["b"], []) == ["b"]
    assert before_dashdash([], []) == []


@pytest.mark.parametrize(
    ("model", "before", "after", "many", "engine", "said"),
    [
        ("m", [], [], False, "reference", None),
        ("m", [], ["--max-num-seqs", "4"], False, "vllm", None),
        ("a", ["b", "c"], [], True, "vllm", None),
        ("m", ["--unit=4"], [], False, "reference", "no such option: --unit=4 (did you mean "
         "--units?)"),
        ("-x", [], [], False, "reference", "no such option: -x (spswap serve --help lists them)"),
        ("a", ["--zzz"], [], True, "reference", "no such option: --zzz (spswap serve --help lists "
         "them; vLLM's own options for --models go in --vllm-args)"),
        ("m", ["b"], [], False, "vllm", "unexpected argument b: spswap serve takes one MODEL "
         "(several models in one job: spswap serve --models A B C)"),
        ("m", ["-"], [], False, "reference", "unexpected argument -: spswap serve takes one MODEL "
         "(several models in one job: spswap serve --models A B C)"),
    ],
)  # fmt: skip
def test_words_problem_says_what_each_stray_word_is(
    model: str, before: list[str], after: list[str], many: bool, engine: str, said: str | None
) -> None:
    got = words_problem(model, before, after, many=many, engine=engine, options=OPTS)
    assert got == said


IGNORED_WITH_VLLM = ("for the reference engine or --models (a vLLM server runs on the job's "
                     "GPU and answers on its own socket, which STATE_DIR/endpoint.json "
                     "names)")  # fmt: skip


@pytest.mark.parametrize(
    ("given", "engine", "many", "said"),
    [
        # each run takes its own options silently
        (["--units", "--kv-cache-gib", "--no-pack", "--port", "--launcher"], "vllm", False, []),
        (["--awake", "--port", "--host", "--device", "--no-pack", "--kv-cache-gib"], "vllm",
         True, []),
        (["--awake", "--port", "--device", "--socket", "--swap-s"], "reference", True, []),
        (["--device", "--socket", "--units", "--drain-s"], "reference", False, []),
        # a job script's options left from another engine or from --models: named
        (["--kv-cache-gib", "--no-pack", "--max-model-len", "--no-eager", "--port"],
         "reference", False,
         ["--kv-cache-gib, --no-pack, --max-model-len, --no-eager ignored: for --engine vllm "
          "only", "--port ignored: for --engine vllm or --models only"]),
        (["--vllm-args", "--pack", "--awake"], "reference", True,
         ["--vllm-args, --pack ignored: for --engine vllm only"]),
        (["--idle-timeout-s", "--awake", "--device", "--socket"], "vllm", False,
         ["--idle-timeout-s, --awake ignored: for --models only",
          f"--device, --socket ignored: {IGNORED_WITH_VLLM}"]),
        (["--launcher", "--host"], "vllm", True,
         ["--launcher ignored: for one model's vLLM server only (--engine vllm without "
          "--models: with --models each model's engine runs in spswap's own Python)",
          "--host ignored: it is the address of --port's TCP endpoint (give --port too)"]),
        (["--launcher", "--kv-cache-gib"], "reference", True,
         ["--kv-cache-gib ignored: for --engine vllm only",
          "--launcher ignored: for one model's vLLM server only (--engine vllm without "
          "--models: with --models each model's engine runs in spswap's own Python)"]),
    ],
)  # fmt: skip
def test_unused_options_are_named_with_the_runs_that_use_them(
    given: list[str], engine: str, many: bool, said: list[str]
) -> None:
    assert unused_options(given, engine=engine, many=many) == said
