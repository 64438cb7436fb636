"""What a failed CRIU run shows the user of its log (pure)."""

from __future__ import annotations

from spswap.checkpoint.criu import log_tail


def test_the_first_error_leads_a_tail_that_leaves_it_out() -> None:
    log = "\n".join(
        ["(00.001) start", "(00.002) Error (criu/files.c:12): Can't dump fd 7", "(00.003) x"]
        + [f"(00.1{i:02d}) unwinding {i}" for i in range(20)]
        + ["(00.200) Error (criu/cr-dump.c:2111): Dumping FAILED."]
    )
    assert log_tail(log, lines=3) == [
        "(00.002) Error (criu/files.c:12): Can't dump fd 7",
        "...",
        "(00.118) unwinding 18",
        "(00.119) unwinding 19",
        "(00.200) Error (criu/cr-dump.c:2111): Dumping FAILED.",
    ]


def test_a_tail_that_holds_every_error_is_left_as_it_is() -> None:
    log = "a\nError (x.c:1): bad\nb\n"
    assert log_tail(log, lines=15) == ["a", "Error (x.c:1): bad", "b"]


def test_at_most_three_early_errors_and_the_rlimit_noise_dropped() -> None:
    log = "\n".join([f"Error (e.c:{i}): e{i}" for i in range(5)] + ["t1", "t2"])
    assert log_tail(log, lines=2) == [
        "Error (e.c:0): e0", "Error (e.c:1): e1", "Error (e.c:2): e2", "...", "t1", "t2"
    ]  # fmt: skip
