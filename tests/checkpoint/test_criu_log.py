"""What a failed CRIU run shows the user of its log (pure)."""

from __future__ import annotations

from pathlib import Path

from spswap.checkpoint.criu import _what, log_tail
from spswap.checkpoint.criu_log import (
    CAP_SYS_RESOURCE_FIX,
    GHOST_FILE_FIX,
    OTHER_RIGHTS_FIX,
    first_error,
    hint_for,
)
from spswap.errors import CheckpointFailed


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


FIXTURES = Path(__file__).parents[1] / "fixtures" / "criu"


def test_what_the_user_is_shown_of_root_criu_failing_on_another_users_process() -> None:
    """A log captured on these machines (root lacks CAP_SYS_RESOURCE): the error the
    job gets leads with CRIU's first error and says what the node lacks."""
    log = (FIXTURES / "root-dump-other-uid-rlimit.log").read_text()
    assert first_error(log) == "Can't get rlimit 0: Operation not permitted"
    assert hint_for(log) == CAP_SYS_RESOURCE_FIX
    e = CheckpointFailed(f"criu dump of pid 16622 into /i/k failed (exit 1): {_what(log)}; the "
                         "partial image was deleted", log_path="/l/k.dump.log",
                         log_tail=log_tail(log))  # fmt: skip
    assert str(e) == (
        "criu dump of pid 16622 into /i/k failed (exit 1): Can't get rlimit 0: Operation not "
        "permitted; root here lacks CAP_SYS_RESOURCE, which root's CRIU needs to read another "
        "user's limits: leave SPSWAP_CRIU_AS_ROOT unset so that CRIU runs as the job's user "
        "(--unprivileged), or give spswapd CAP_SYS_RESOURCE; spswap doctor test-dumps both "
        "ways; the partial image was deleted\n"
        "last lines of /l/k.dump.log:\n"
        "(00.045322) Error (criu/cr-dump.c:371): Can't get rlimit 0: Operation not permitted\n"
        "...\n"
        "(00.045324) Error (criu/cr-dump.c:1720): Dump core (pid: 16622) failed with -1\n"
        "(00.045339) Waiting for 16622 to trap\n"
        "(00.045342) Daemon 16622 exited trapping\n"
        "(00.045345) Sent msg to daemon 3 0 0\n"
        "pie: 16622: __fetched msg: 3 0 0\n"
        "pie: 16622: 16622: new_sp=0x7f2062482e88 ip 0x7f206281a501\n"
        "(00.045389) 16622 was trapped\n"
        "(00.045396) 16622 was trapped\n"
        "(00.045397) 16622 (native) is going to execute the syscall 15, required is 15\n"
        "(00.045405) 16622 was stopped\n"
        "(00.045575) net: Unlock network\n"
        "(00.045583) Unfreezing tasks into 1\n"
        "(00.045584) \tUnseizing 16622 into 1\n"
        "(00.045620) \tUnseizing 16623 into 1\n"
        "(00.045637) Error (criu/cr-dump.c:2111): Dumping FAILED."
    )


def test_what_the_user_is_shown_when_a_setuid_child_stops_criu_as_the_user() -> None:
    log = (FIXTURES / "user-dump-setuid-child-map-files.log").read_text()
    assert _what(log) == ("Can't open 22499/map_files on procfs: Permission denied; "
                          + OTHER_RIGHTS_FIX)  # fmt: skip
    assert log_tail(log)[8:10] == [
        "(00.021724) Error (criu/proc_parse.c:794): Can't open 22499/map_files on procfs: "
        "Permission denied",
        "(00.021726) Error (criu/cr-dump.c:1570): Collect mappings (pid: 22499) failed with -1",
    ]


def test_the_first_error_skips_the_rlimit_noise() -> None:
    log = ("(00.01) Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self: x\n"
           "(00.02) Error (criu/files.c:12): Can't dump fd 7\n")  # fmt: skip
    assert first_error(log) == "Can't dump fd 7"
    assert first_error("(00.01) all fine\n") is None


def test_a_deleted_mapped_file_is_named_as_such() -> None:
    """A pool entry removed with --force while a job maps it: CRIU refuses the ghost file
    (its line as CRIU 4.1 logs it); the hint says why and what follows."""
    log = (
        "(00.412) Error (criu/files-reg.c:1005): Can't dump ghost file /dev/shm/spswap/pool/"
        ".tmp-10698-x/data.bin of 84447232 size, increase limit\n"
        "(00.413) Error (criu/cr-dump.c:2111): Dumping FAILED."
    )
    assert first_error(log) == (
        "Can't dump ghost file /dev/shm/spswap/pool/.tmp-10698-x/data.bin of 84447232 size, "
        "increase limit"
    )
    assert hint_for(log) == GHOST_FILE_FIX
    assert GHOST_FILE_FIX.startswith("a file the process maps was deleted while it ran")
