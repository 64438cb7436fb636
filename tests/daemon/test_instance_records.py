"""A user's instance records reach `spswap status` through spswapd (issue 15 item 7):
run/ is root's, so a user's serving process could not write its record ("could not update
the instance record ([Errno 13] Permission denied)" at every state change). As the second
uid, against a real daemon."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from spswap.config import Config
from spswap.daemon.client import Client
from spswap.errors import SpswapError
from spswap.instance.registry import InstanceRecord, InstanceRegistry
from spswap.status import collect_status, render_status
from tests.uids import as_user, spawn_as


def _record(instance_id: str, **kw: Any) -> InstanceRecord:
    return InstanceRecord(id=instance_id, model="small", state="serving", pid=kw.pop("pid", 1),
                          uid=kw.pop("uid", 0), job_id="7", **kw)  # fmt: skip


def _put_as_user(directory: str) -> dict[str, Any]:
    logged: list[str] = []
    # a forged uid and pid: the daemon writes the caller's own
    instance_id = f"7-{os.getpid()}"  # as serve names them: <job>-<pid>
    InstanceRegistry(Path(directory)).put_best_effort(_record(instance_id), logged.append)
    return {"logged": logged, "pid": os.getpid(), "id": instance_id}


def _put_raw_as_user(root: str, record: dict[str, Any]) -> str:
    record = {**record, "id": record["id"].replace("PID", str(os.getpid()))}
    try:
        Client(Config.from_env({}, root=Path(root))).call("instance.put", record=record)
    except SpswapError as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def _remove_as_user(directory: str, instance_id: str) -> bool:
    InstanceRegistry(Path(directory)).remove(instance_id)
    return (Path(directory) / f"{instance_id}.json").exists()


def test_a_users_record_goes_through_the_daemon(cfg: Config, daemon: int, user_uid: int) -> None:
    directory = cfg.paths.instances
    got = as_user(user_uid, _put_as_user, str(directory))
    assert got["logged"] == []
    rec = InstanceRecord.from_json(json.loads((directory / f"{got['id']}.json").read_text()))
    assert (rec.uid, rec.pid, rec.state, rec.model) == (user_uid, got["pid"], "serving", "small")
    assert [i["id"] for i in collect_status(cfg, gpus=[])["instances"]] == [got["id"]]

    # root's record: not hers to overwrite or remove
    InstanceRegistry(directory).put(_record("root-1", uid=0, pid=os.getpid()))
    refused = as_user(user_uid, _put_raw_as_user, str(cfg.root),
                      _record("root-1").to_json())  # fmt: skip
    assert refused.startswith("BadRequest: instance id 'root-1' does not carry your process's")
    assert as_user(user_uid, _remove_as_user, str(directory), "root-1") is True
    assert InstanceRecord.from_json(json.loads((directory / "root-1.json").read_text())).uid == 0
    # a name that is not a plain file name
    bad = as_user(user_uid, _put_raw_as_user, str(cfg.root),
                  _record("../../pool/x").to_json())  # fmt: skip
    assert bad.startswith("BadRequest: instance id '../../pool/x': use letters")
    # her own: removed through the daemon
    assert as_user(user_uid, _remove_as_user, str(directory), got["id"]) is False
    assert sorted(p.name for p in directory.iterdir()) == ["root-1.json"]


def _put_taken_as_user(root: str, sync: str) -> str:
    """Put ``7-<own pid>`` once root has put a record of that id (``sync``/go)."""
    # written whole, then renamed: the waiting side must never read an empty pid
    Path(sync, "pid.new").write_text(str(os.getpid()))
    os.rename(Path(sync, "pid.new"), Path(sync, "pid"))
    while not Path(sync, "go").exists():
        time.sleep(0.01)
    return _put_raw_as_user(root, _record("7-PID").to_json())


def test_a_users_record_cannot_break_or_steer_other_users_status(
    cfg: Config, daemon: int, user_uid: int
) -> None:
    """Every field is text of bounded length, shown as plain text: a number where text
    belongs broke every user's `spswap status` (TypeError), a markup name broke it or
    became a hyperlink in other users' terminals; a user's id carries the caller's pid,
    so no user takes the id of another's live instance first."""
    put = lambda **kw: as_user(user_uid, _put_raw_as_user, str(cfg.root),  # noqa: E731
                               {**_record("7-PID").to_json(), **kw})  # fmt: skip
    assert put(reason=7) == ("BadRequest: an instance record's reason is text of at most 4096 "
                             "characters, or null")  # fmt: skip
    assert put(model=5).startswith("BadRequest: an instance record's model is text of at most "
                                   "256 characters")  # fmt: skip
    assert put(model="x" * 257).startswith("BadRequest: an instance record's model is text")
    assert put(job_id="../7").startswith("BadRequest: job id '../7' is not a Slurm job id")
    assert put(id="7-4242").startswith("BadRequest: instance id '7-4242' does not carry your")
    link = "[link=https://evil.example/]click[/link]"
    assert put(model=link, reason="m[/bold]") == "ok"
    console = Console(width=400, record=True, force_terminal=True)
    console.print(render_status(collect_status(cfg, gpus=[])))
    shown, styled = console.export_text(clear=False), console.export_text(styles=True)
    assert link in shown and "m[/bold]" in shown
    assert "\x1b]8;" not in styled  # no hyperlink escape sequence

    # a record of another uid under the id the user's process will use: refused while its
    # process lives, the user's to replace once it is gone
    assert _put_over(cfg, user_uid, os.getpid()).startswith(
        "PermissionDenied: instance record 7-")  # fmt: skip
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert _put_over(cfg, user_uid, gone.pid) == "ok"


def _put_over(cfg: Config, user_uid: int, owner_pid: int) -> str:
    """The user's put of ``7-<its pid>`` after root put one of that id for ``owner_pid``."""
    sync = Path(tempfile.mkdtemp(dir=cfg.root))
    os.chmod(sync, 0o777)
    child = spawn_as(user_uid, _put_taken_as_user, str(cfg.root), str(sync))
    while not (sync / "pid").exists():
        time.sleep(0.01)
    taken = f"7-{(sync / 'pid').read_text()}"
    InstanceRegistry(cfg.paths.instances).put(_record(taken, uid=0, pid=owner_pid))
    (sync / "go").touch()
    return str(child.result())
