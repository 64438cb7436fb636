"""Golden tests: the exact command lines spswap runs CRIU with."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spswap.checkpoint import criu_argv as a


def test_check_and_version() -> None:
    assert a.check_argv("/usr/local/sbin/criu") == ["/usr/local/sbin/criu", "check"]
    assert a.version_argv("criu") == ["criu", "--version"]


def test_dump_minimal() -> None:
    argv = a.dump_argv("criu", pid=42, images_dir=Path("/shm/images/.tmp-k-1"), shell_job=False)
    assert argv == [
        "criu", "dump", "--tree", "42", "--images-dir", "/shm/images/.tmp-k-1",
        "-v4", "--log-file", "dump.log",
    ]  # fmt: skip


def test_dump_every_flag() -> None:
    argv = a.dump_argv(
        "/opt/criu/criu", pid=7, images_dir=Path("/img dir/x"), log_file="-",
        leave_running=True, shell_job=True, tcp_close=True, ghost_limit_bytes=1 << 20,
        ext_unix_sk=True, link_remap=True, action_script=Path("/img dir/x/keep.sh"),
    )  # fmt: skip
    assert argv == [
        "/opt/criu/criu", "dump", "--tree", "7", "--images-dir", "/img dir/x",
        "-v4", "--log-file", "-", "--leave-running", "--shell-job", "--tcp-close",
        "--ext-unix-sk", "--link-remap", "--action-script", "/img dir/x/keep.sh",
        "--ghost-limit", "1048576",
    ]  # fmt: skip


def test_post_dump_script_is_exact() -> None:
    text = a.post_dump_script(
        [("/sys/fs/cgroup/freezer/spswap-parked-x/freezer.state", "FROZEN")],
        ["/dev/shm", "/tmp/a b"],
        ".spswap-remap-jobk-link_remap.",
    )
    assert text == (
        "#!/bin/sh\n"
        "# spswap: post-dump of a dump that leaves the tree running\n"
        '[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\n'
        "echo FROZEN > /sys/fs/cgroup/freezer/spswap-parked-x/freezer.state\n"
        "for f in /dev/shm/link_remap.*; do\n"
        '  id="${f##*/link_remap.}"\n'
        '  case "$id" in ""|*[!0-9]*) continue;; esac\n'
        '  [ -f "$f" ] && [ ! -L "$f" ] && ln -P -- "$f" '
        '/dev/shm/.spswap-remap-jobk-link_remap."$id"\n'
        "done\n"
        "for f in '/tmp/a b'/link_remap.*; do\n"
        '  id="${f##*/link_remap.}"\n'
        '  case "$id" in ""|*[!0-9]*) continue;; esac\n'
        '  [ -f "$f" ] && [ ! -L "$f" ] && ln -P -- "$f" '
        "'/tmp/a b/.spswap-remap-jobk-link_remap.'\"$id\"\n"
        "done\n"
        "exit 0\n"
    )


def test_post_dump_script_asking_root_is_exact() -> None:
    text = a.post_dump_script(
        [("/sys/fs/cgroup/x/freezer.state", "FROZEN")],
        [],
        ".p.",
        root_fifos=("/r/.postdump-a/request", "/r/.postdump-a/answer"),
    )
    assert text == (
        "#!/bin/sh\n"
        "# spswap: post-dump of a dump that leaves the tree running\n"
        '[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\n'
        "echo post-dump > /r/.postdump-a/request\n"
        "read -r _ < /r/.postdump-a/answer\n"
        "exit 0\n"
    )  # the user's CRIU writes no root file: root makes the freeze when asked


def test_dump_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="pid"):
        a.dump_argv("criu", pid=0, images_dir=Path("/x"), shell_job=False)
    with pytest.raises(ValueError, match="ghost_limit"):
        a.dump_argv("criu", pid=1, images_dir=Path("/x"), shell_job=False, ghost_limit_bytes=-1)


def test_restore_default_is_detached() -> None:
    argv = a.restore_argv(
        "criu", images_dir=Path("/shm/images/k"), pidfile=Path("/tmp/p"), shell_job=False
    )
    assert argv == [
        "criu", "restore", "--images-dir", "/shm/images/k", "-v4", "--log-file",
        "restore.log", "--pidfile", "/tmp/p", "--manage-cgroups=ignore", "--restore-detached",
    ]  # fmt: skip


def test_restore_every_flag() -> None:
    argv = a.restore_argv(
        "criu", images_dir=Path("/i"), log_file="-", pidfile=Path("/p"),
        restore_detached=False, shell_job=True, tcp_close=True, ext_unix_sk=True,
        auto_dedup=True,
    )  # fmt: skip
    assert argv == [
        "criu", "restore", "--images-dir", "/i", "-v4", "--log-file", "-", "--pidfile", "/p",
        "--manage-cgroups=ignore", "--shell-job", "--tcp-close", "--ext-unix-sk", "--auto-dedup",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Version: 4.1.1\n", (4, 1, 1)),
        ("Version: 4.2\nGitID: v4.2\n", (4, 2, 0)),
        ("Version: 3.17.1\n", (3, 17, 1)),
        ("Version: 4.1.1 (gitid 0)\n", (4, 1, 1)),
        ("Version: 4.0-rc1\n", (4, 0, 0)),
        ("criu: command failed\n", None),
        ("", None),
    ],
)
def test_parse_version(text: str, expected: tuple[int, int, int] | None) -> None:
    assert a.parse_version(text) == expected


def test_a_dump_with_a_criu_setting_naming_no_program_says_the_setting_is_wrong(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from spswap.checkpoint import criu as criu_mod
    from spswap.errors import CheckpointFailed

    monkeypatch.setenv("SPSWAP_CRIU", str(tmp_path / "no-criu"))
    with pytest.raises(CheckpointFailed, match=f"SPSWAP_CRIU={tmp_path}/no-criu is not an "
                                               "executable file"):  # fmt: skip
        criu_mod.dump(os.getpid(), "k", tmp_path / "images")
    assert not (tmp_path / "images").exists() or not any((tmp_path / "images").iterdir())
