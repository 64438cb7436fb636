"""A user's instance records reach `spswap status` through spswapd (issue 15 item 7):
run/ is root's, so a user's serving process could not write its record ("could not update
the instance record ([Errno 13] Permission denied)" at every state change). As the second
uid, against a real daemon."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from spswap.config import Config
from spswap.daemon.client import Client
from spswap.errors import SpswapError
from spswap.instance.registry import InstanceRecord, InstanceRegistry
from spswap.status import collect_status
from tests.uids import as_user


def _record(instance_id: str, **kw: Any) -> InstanceRecord:
    return InstanceRecord(id=instance_id, model="small", state="serving", pid=kw.pop("pid", 1),
                          uid=kw.pop("uid", 0), job_id="7", **kw)  # fmt: skip


def _put_as_user(directory: str, instance_id: str) -> dict[str, Any]:
    logged: list[str] = []
    # a forged uid and pid: the daemon writes the caller's own
    InstanceRegistry(Path(directory)).put_best_effort(_record(instance_id), logged.append)
    return {"logged": logged, "pid": os.getpid()}


def _put_raw_as_user(root: str, record: dict[str, Any]) -> str:
    try:
        Client(Config.from_env({}, root=Path(root))).call("instance.put", record=record)
    except SpswapError as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def _remove_as_user(directory: str, instance_id: str) -> bool:
    InstanceRegistry(Path(directory)).remove(instance_id)
    return (Path(directory) / f"{instance_id}.json").exists()


def test_a_users_record_goes_through_the_daemon(cfg: Config, daemon: int, user_uid: int) -> None:
    directory = cfg.paths.run / "instances"
    got = as_user(user_uid, _put_as_user, str(directory), "7-4242")
    assert got["logged"] == []
    rec = InstanceRecord.from_json(json.loads((directory / "7-4242.json").read_text()))
    assert (rec.uid, rec.pid, rec.state, rec.model) == (user_uid, got["pid"], "serving", "small")
    assert [i["id"] for i in collect_status(cfg, gpus=[])["instances"]] == ["7-4242"]

    # root's record: not hers to overwrite or remove
    InstanceRegistry(directory).put(_record("root-1", uid=0, pid=os.getpid()))
    refused = as_user(user_uid, _put_raw_as_user, str(cfg.root),
                      _record("root-1").to_json())  # fmt: skip
    assert refused.startswith("PermissionDenied: instance record root-1 belongs to uid 0")
    assert as_user(user_uid, _remove_as_user, str(directory), "root-1") is True
    assert InstanceRecord.from_json(json.loads((directory / "root-1.json").read_text())).uid == 0
    # a name that is not a plain file name
    bad = as_user(user_uid, _put_raw_as_user, str(cfg.root),
                  _record("../../pool/x").to_json())  # fmt: skip
    assert bad.startswith("BadRequest: instance id '../../pool/x': use letters")
    # her own: removed through the daemon
    assert as_user(user_uid, _remove_as_user, str(directory), "7-4242") is False
    assert sorted(p.name for p in directory.iterdir()) == ["root-1.json"]
