"""The words of a spswap serve command line that are not its options (pure)."""

from __future__ import annotations

import pytest

from spswap.cli.serve_words import before_dashdash, words_problem

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
