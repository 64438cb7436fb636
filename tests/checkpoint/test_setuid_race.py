"""A second uid's tree that execs a setuid, setgid or file-capability program at varying
delays around its dump (issue 19 item 2): no image whose processes hold another uid,
gid or a capability is ever kept nor restored, by CRIU as the user (the default path) or
by root's CRIU (SPSWAP_CRIU_AS_ROOT=1).

Each tree is a user's Python loop that, once told "go", waits ``delay`` ms and forks a
child that execs the program; the test says "go" and calls the daemon's dump at once, so
the exec lands before, inside or after the window between the credential check and
CRIU's seize. The programs are root's copies of ``sleep`` made setuid root, setgid root,
or given cap_net_raw; the test removes them.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spswap.checkpoint import criu, image_creds
from spswap.checkpoint.images import Identity
from spswap.checkpoint.service import dump_instance, images_of_job, restore_instance
from spswap.errors import CheckpointFailed

from .criu_helpers import needs_criu

FAKE_CRIU = Path(__file__).with_name("fake_criu.py")
REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.criu, pytest.mark.slow, needs_criu]

# The job's instance: waits for "go", then after DELAY ms forks the program (it runs on
# as a child of the tree, so CRIU dumps it if it is there), and loops.
TREE = """
import os, sys, time
work, program, delay_ms = sys.argv[1], sys.argv[2], float(sys.argv[3])
open(work + "/ready", "w").close()
while not os.path.exists(work + "/go"):
    time.sleep(0.0005)
time.sleep(delay_ms / 1000)
if os.fork() == 0:
    os.execv(program, [program, "30"])
while True:
    time.sleep(0.01)
"""

DELAYS_MS = [0, 1, 2, 3, 5, 8, 12, 16, 20, 25, 30, 40, 50, 60, 80, 100, 150]


@pytest.fixture(scope="module")
def programs() -> Iterator[dict[str, Path]]:
    """Root's setuid, setgid and file-capability copies of sleep (in a 0755 folder)."""
    top = Path(tempfile.mkdtemp(prefix="spswap-suid-", dir="/tmp"))
    os.chmod(top, 0o755)
    made = {}
    for kind, mode in (("setuid", 0o4755), ("setgid", 0o2755), ("caps", 0o755)):
        p = top / f"{kind}-sleep"
        shutil.copy("/bin/sleep", p)
        os.chown(p, 0, 0)
        os.chmod(p, mode)
        made[kind] = p
    r = subprocess.run(["setcap", "cap_net_raw+ep", str(made["caps"])], capture_output=True)
    if r.returncode != 0:
        del made["caps"]
    try:
        yield made
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _identity(uid: int) -> Identity:
    return Identity("test", "1", "-", "-", "-", "-", "4.1", "sha256:0", uid, "c0")


def _status(pid: int) -> dict[str, list[str]]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.split() for k, _, v in (line.partition(":") for line in lines)}


def _exe(pid: int) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return None


def _tree_pids(pid: int) -> list[int]:
    from spswap.checkpoint.proctree import process_tree_pids

    try:
        return process_tree_pids(pid)
    except OSError:
        return []


def _start_tree(uid: int, work: Path, program: Path, delay_ms: float) -> int:
    gid = pwd.getpwuid(uid).pw_gid
    subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "sh", "-c",
         'setsid /usr/bin/python3 -c "$0" "$1" "$2" "$3" </dev/null >/dev/null 2>&1 & '
         'echo $! > "$1/pid"', TREE, str(work), str(program), str(delay_ms)],
        check=True, timeout=10,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not (work / "ready").exists():
        assert time.monotonic() < deadline, "the tree never started"
        time.sleep(0.005)
    return int((work / "pid").read_text())


def _foreign(image: Path, uid: int, groups: set[int]) -> str | None:
    """What of another user's rights the image holds (read back from its core files)."""
    return image_creds.image_problem(image, uid, groups)


def _run_race(
    programs: dict[str, Path], uid: int, as_user: bool, criu_path: Path | None = None,
    delays_ms: list[float] = DELAYS_MS,
) -> dict[str, int]:  # fmt: skip
    """Every program at every delay; returns how the dumps ended. ``criu_path``: the
    stand-in for root's CRIU (no restore then: it makes no restorable image)."""
    groups = set(os.getgrouplist(pwd.getpwuid(uid).pw_name, pwd.getpwuid(uid).pw_gid))
    outcomes: dict[str, int] = {}
    top = Path(tempfile.mkdtemp(prefix="spswap-race-", dir="/tmp"))
    os.chmod(top, 0o755)
    images = top / "images"
    try:
        for kind, program in programs.items():
            for delay in delays_ms:
                work = top / f"{kind}-{delay}"
                work.mkdir()
                os.chown(work, uid, -1)
                pid = _start_tree(uid, work, program, delay)
                job = f"{kind}{delay}"
                try:
                    (work / "go").touch()
                    try:
                        dump_instance(images, job_id=job, pid=pid, identity=_identity(uid),
                                      criu_as_user=as_user, criu_path=criu_path)  # fmt: skip
                        outcome = "dumped"
                    except CheckpointFailed as e:
                        outcome = "refused" if ("credentials" in str(e) or "not dumped" in str(e)
                                                ) else "failed"  # fmt: skip
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1
                    for image in [*images_of_job(images, job)]:
                        bad = _foreign(image, uid, groups)
                        assert bad is None, f"{kind} at {delay} ms: an image was kept: {bad}"
                    if criu_path is not None:
                        _check_seen(images, uid, kind, delay)
                    elif outcome == "dumped":
                        _restore_and_check(images, job, uid, kind, delay, program)
                finally:
                    for p in _tree_pids(pid) or [pid]:
                        try:
                            os.kill(p, 9)
                        except ProcessLookupError:
                            pass
    finally:
        shutil.rmtree(top, ignore_errors=True)
    return outcomes


def _check_seen(images: Path, uid: int, kind: str, delay: float) -> None:
    """What the stand-in CRIU was handed (at the moment CRIU would seize): only the
    user's processes with the user's rights."""
    seen = images / "seen.json"
    if not seen.exists():
        return  # refused before CRIU ran
    for line in seen.read_text().splitlines():
        for pid, st in json.loads(line).items():
            assert st["Uid"] == [str(uid)] * 4, f"{kind} at {delay} ms: CRIU got {pid}: {st}"
            assert len(set(st["Gid"])) == 1, f"{kind} at {delay} ms: CRIU got {pid}: {st}"
            assert int(st["CapEff"][0], 16) == 0, f"{kind} at {delay} ms: CRIU got {pid}: {st}"
    seen.unlink()


def _restore_and_check(images: Path, job: str, uid: int, kind: str, delay: float,
                       program: Path) -> None:  # fmt: skip
    """A kept image comes back with nothing but the user's rights. A child the image held
    between its fork and its exec (the image has it with the user's rights: checked
    before) goes on to exec the program once restored, and gains what the program gives
    any user who runs it: that process is skipped, as it would run outside CRIU too."""
    info = criu.read_json(images_of_job(images, job)[0] / criu.DUMP_META) or {}
    criu.wait_pids_free([*info.get("pids", []), *info.get("tids", [])], 10)
    pid, _ = restore_instance(images, job_id=job, expected=_identity(uid), check_integrity=False)
    try:  # the processes the image held (the restored loop may fork the program anew)
        for p in set(_tree_pids(pid)) & set(info.get("pids", [])):
            if _exe(p) == program:
                continue
            st = _status(p)
            assert st["Uid"] == [str(uid)] * 4, f"{kind} at {delay} ms restored {p}: {st['Uid']}"
            assert len(set(st["Gid"])) == 1, f"{kind} at {delay} ms restored {p}: {st['Gid']}"
            assert int(st["CapPrm"][0], 16) == 0 and int(st["CapEff"][0], 16) == 0
    finally:
        for p in _tree_pids(pid):
            os.kill(p, 9)


def test_no_image_with_another_users_rights_by_criu_as_the_user(
    programs: dict[str, Path], user_uid: int
) -> None:
    outcomes = _run_race(programs, user_uid, as_user=True)
    assert outcomes.get("dumped", 0) + outcomes.get("refused", 0) > 0, outcomes


@pytest.fixture
def root_criu_stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Root's CRIU cannot dump another uid's tree here (no CAP_SYS_RESOURCE): a stand-in
    that records the credentials it was handed (see fake_criu.py)."""
    wrapper = tmp_path / "criu"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_CRIU} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("SPSWAP_FAKE_CRIU_PATH", str(REPO))
    return wrapper


def test_root_criu_is_never_handed_a_tree_with_another_users_rights(
    programs: dict[str, Path], user_uid: int, root_criu_stand_in: Path
) -> None:
    """The root path (SPSWAP_CRIU_AS_ROOT=1): whenever CRIU starts, the tree it gets
    holds only the user's rights (frozen since the check), and no image with others is
    kept."""
    # (2 s: an exec surely after the dump, whatever the machine's load: one "dumped")
    outcomes = _run_race(programs, user_uid, as_user=False, criu_path=root_criu_stand_in,
                         delays_ms=[*DELAYS_MS, 2000])  # fmt: skip
    assert outcomes.get("dumped", 0) > 0 and outcomes.get("refused", 0) > 0, outcomes


def test_an_image_that_records_other_rights_is_deleted_and_says_why(
    user_uid: int, root_criu_stand_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever happened before CRIU's seize, the image's own credentials decide: a
    CRIU that records a task with euid 0 (as a setuid exec just before the seize would
    be recorded) leaves no image, and the job's error says why."""
    monkeypatch.setenv("SPSWAP_FAKE_CRIU_EUID", "0")
    top = Path(tempfile.mkdtemp(prefix="spswap-race-", dir="/tmp"))
    os.chmod(top, 0o755)
    work = top / "w"
    work.mkdir()
    os.chown(work, user_uid, -1)
    pid = _start_tree(user_uid, work, Path("/bin/sleep"), 0)
    try:
        with pytest.raises(CheckpointFailed) as e:
            dump_instance(top / "images", job_id="j1", pid=pid, identity=_identity(user_uid),
                          criu_as_user=False, criu_path=root_criu_stand_in)  # fmt: skip
        assert "was deleted, never kept" in str(e.value)
        assert f"was dumped with uids [{user_uid}, 0, {user_uid}, {user_uid}]" in str(e.value)
        assert not images_of_job(top / "images", "j1")
        assert not [p for p in (top / "images").iterdir() if p.name.startswith(".tmp-")]
    finally:
        for p in _tree_pids(pid) or [pid]:
            try:
                os.kill(p, 9)
            except ProcessLookupError:
                pass
        shutil.rmtree(top, ignore_errors=True)


def test_the_program_is_really_privileged(programs: dict[str, Path], user_uid: int) -> None:
    """The race tests mean something only if the programs run with other rights."""
    top = Path(tempfile.mkdtemp(prefix="spswap-suid-check-", dir="/tmp"))
    os.chmod(top, 0o755)
    os.chown(top, user_uid, -1)
    try:
        pid = _start_tree(user_uid, top, programs["setuid"], 0)
        (top / "go").touch()
        deadline = time.monotonic() + 5
        while True:
            kids = [p for p in _tree_pids(pid) if p != pid]
            if kids and _status(kids[0])["Uid"][1] == "0":
                break
            assert time.monotonic() < deadline, "the setuid child never ran as euid 0"
            time.sleep(0.01)
        assert stat.S_IMODE(programs["setuid"].stat().st_mode) == 0o4755
        for p in _tree_pids(pid):
            os.kill(p, 9)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_an_image_that_records_other_rights_is_never_restored(user_uid: int,
                                                              tmp_path: Path) -> None:  # fmt: skip
    """An image (its identity and integrity good) whose recorded credentials are not the
    job user's (an image from before this check, or one a setuid exec got into) is
    refused before CRIU runs, and deleted."""
    from spswap.checkpoint.images import write_meta
    from spswap.checkpoint.service import job_image_key
    from spswap.errors import ImageRejected

    from . import criu_images as ci

    identity = _identity(user_uid)
    gid = pwd.getpwuid(user_uid).pw_gid
    image = tmp_path / job_image_key("j2", identity)
    image.mkdir(mode=0o700)
    (image / criu.DUMP_META).write_text(
        json.dumps(  # as CRIU as the user dumped it
            {"pid": 4242, "pids": [4242], "run_as": {"uid": user_uid, "gid": gid, "groups": [gid]}}
        )
    )
    (image / "pstree.img").write_bytes(ci.pstree_img([(4242, 1, [4242])]))
    (image / "core-4242.img").write_bytes(ci.core_img(1, ci.creds((user_uid, 0, 0, 0), (gid,) * 4)))
    write_meta(image, identity)
    with pytest.raises(ImageRejected) as e:
        restore_instance(tmp_path, job_id="j2", expected=identity)
    assert str(e.value) == (
        f"image {image.name} not restored: its processes' credentials are not the job user's: "
        f"task 4242 was dumped with uids [{user_uid}, 0, 0, 0], not only {user_uid}"
    )
    assert not image.exists()
