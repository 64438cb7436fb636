"""The last line of a multi-model job's instance (``spswap serve --models``): what stopped
it, what each model answered and failed, that the engines ended; and the models given
twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from spswap.errors import ConfigError
from spswap.multi.serve import check_names
from spswap.serve.run_end import models_end_text


def test_the_end_line_counts_each_models_answers_and_says_the_engines_ended() -> None:
    assert models_end_text("SIGTERM", {"m1": 3, "m2": 0, "m3": 1}, {"m1": 0, "m2": 1}) == (
        "stopped by SIGTERM; its 3 models answered 4 requests since they started (m1 3, "
        "m2 0, m3 1), 1 failed (m2 1), and their engines ended")  # fmt: skip
    assert models_end_text("SIGINT", {"m1": 0, "m2": 0}, {}) == (
        "stopped by SIGINT; its 2 models answered 0 requests since they started (m1 0, m2 0), "
        "and their engines ended")  # fmt: skip
    # ended before its models were up: nothing to count
    assert models_end_text("SIGTERM", {}, {}) == "stopped by SIGTERM"


def test_the_end_line_does_not_say_engines_ended_that_could_not_be_ended() -> None:
    # (the line before it says what could not be done and why)
    assert models_end_text("SIGTERM", {"m1": 2, "m2": 1}, {}, engines_ended=False) == (
        "stopped by SIGTERM; its 2 models answered 3 requests since they started (m1 2, m2 1)"
    )


def test_the_same_directory_twice_is_a_slip_and_two_of_one_name_need_a_rename() -> None:
    with pytest.raises(ConfigError) as e:
        check_names((Path("/m/a"), Path("/m/b"), Path("/m/a")))
    assert str(e.value) == ("/m/a is given more than once after --models: give each model "
                            "directory once")  # fmt: skip
    with pytest.raises(ConfigError) as e:
        check_names((Path("/m/a"), Path("/m/b"), Path("/m/a"), Path("/m/b")))
    assert str(e.value) == ("/m/a, /m/b are given more than once after --models: give each "
                            "model directory once")  # fmt: skip
    with pytest.raises(ConfigError) as e:
        check_names((Path("/m/a"), Path("/n/a")))
    assert str(e.value) == ("more than one model directory is named a: requests name a model "
                            "by its directory's name; rename one")  # fmt: skip
