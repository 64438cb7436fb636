"""Slots through spswapd for a second real uid: held by the caller, never writable by it."""

from __future__ import annotations

import os
import stat
import time
from typing import Any

from spswap import access
from spswap.config import Config
from spswap.daemon.client import Client
from spswap.slots.table import SlotTable
from tests.security.conftest import TEST_USER, as_user, outcome, spawn_as


def _register(cfg: Config, user_uid: int) -> None:
    root = Client(cfg)
    root.call("job.register", job_id="100", uid=0, user="root")
    root.call("job.register", job_id="200", uid=user_uid, user=TEST_USER)
    root.call("job.register", job_id="201", uid=user_uid, user=TEST_USER)
    root.call("job.end", job_id="201")


def _user_session(cfg: Config, root_rid: str) -> dict[str, Any]:
    out: dict[str, Any] = {"pid": os.getpid()}
    r = access.reserve_slot(cfg, model="mine", units=1, allowed_gpus=[0], job_id="200",
                            timeout_s=5)  # fmt: skip
    out["mine"] = r.to_json()
    table = SlotTable(cfg.paths.slots, [0, 1])
    out["read_only"] = table.read_only
    out["seen"] = sorted(x.id for x in table.reservations())  # read without the lock
    out["snapshot_units_free"] = [g["units_free"] for g in table.snapshot()["gpus"]]
    out["other_job"] = outcome(access.reserve_slot, cfg, model="x", units=1, job_id="100",
                               timeout_s=1)  # fmt: skip
    out["unregistered_job"] = outcome(access.reserve_slot, cfg, model="x", units=1,
                                      job_id="999", timeout_s=1)  # fmt: skip
    out["ended_job"] = outcome(access.reserve_slot, cfg, model="x", units=1, job_id="201",
                               timeout_s=1)  # fmt: skip
    out["release_root"] = outcome(access.release_slot, cfg, root_rid)
    out["direct_reserve"] = outcome(table.reserve, model="x", units=1, timeout_s=1)
    for name in ("state.json", "slots.lock"):
        out[f"write_{name}"] = outcome(open, cfg.paths.slots / name, "r+")
    out["create_file"] = outcome(open, cfg.paths.slots / "mine.json", "w")
    # not even for reading: a flock needs no more, and held it would stop every reservation
    out["read_slots.lock"] = outcome(open, cfg.paths.slots / "slots.lock")
    out["release_mine"] = outcome(access.release_slot, cfg, r.id)
    out["after"] = sorted(x.id for x in table.reservations())
    return out


def test_user_reserves_through_daemon_only(cfg: Config, daemon: int, user_uid: int) -> None:
    _register(cfg, user_uid)
    table = SlotTable.from_config(cfg)
    rootres = access.reserve_slot(cfg, model="root-model", units=2, allowed_gpus=[0],
                                  timeout_s=5)  # fmt: skip
    for path, mode in ((cfg.paths.slots, 0o755), (table.state_path, 0o644),
                       (table.lock_path, 0o600)):  # fmt: skip
        st = os.stat(path)
        assert (stat.S_IMODE(st.st_mode), st.st_uid) == (mode, 0), path

    out = as_user(user_uid, _user_session, cfg, rootres.id)

    mine = out["mine"]
    assert mine["holder"]["pid"] == out["pid"] and mine["holder"]["uid"] == user_uid
    assert mine["holder"]["job_id"] == "200" and mine["holder"]["pid_start"]
    assert mine["gpus"] == [0] and len(mine["units"]) == 1
    assert out["read_only"] is True
    assert out["seen"] == sorted([rootres.id, mine["id"]])
    assert out["snapshot_units_free"] == [1, 4]
    assert out["other_job"].startswith("PermissionDenied: job 100 belongs to uid 0"), out
    assert out["unregistered_job"].startswith("PermissionDenied: job 999 is not registered")
    assert out["ended_job"].startswith("PermissionDenied: job 201 has ended"), out
    assert out["release_root"].startswith("PermissionDenied: "), out
    assert out["direct_reserve"].startswith(
        "PermissionDenied: cannot reserve a slot: the slot table ("
    )
    assert "spswap daemon start" in out["direct_reserve"]
    for key in ("write_state.json", "write_slots.lock", "create_file", "read_slots.lock"):
        assert out[key].startswith("PermissionError: "), (key, out[key])
    assert out["release_mine"] == "ok"
    assert out["after"] == [rootres.id]
    # root's reservation is untouched; root (direct) may release it
    assert [r.id for r in table.reservations()] == [rootres.id]
    assert access.release_slot(cfg, rootres.id).id == rootres.id
    assert table.reservations() == []


def _wait_for_slot(cfg: Config, timeout_s: float) -> Any:
    try:
        r = access.reserve_slot(cfg, model="waiter", units=4, allowed_gpus=[1],
                                timeout_s=timeout_s)  # fmt: skip
    except Exception as e:
        return [type(e).__name__, str(e), os.getpid()]
    return [r.to_json(), time.time(), os.getpid()]


def test_long_wait_in_daemon_blocks_nobody(cfg: Config, daemon: int, user_uid: int) -> None:
    held = access.reserve_slot(cfg, model="hog", units=4, allowed_gpus=[1], timeout_s=5)
    waiter = spawn_as(user_uid, _wait_for_slot, cfg, 20.0)
    client = Client(cfg)
    deadline = time.monotonic() + 10
    while not client.call("slots.list")["waiters"]:
        assert time.monotonic() < deadline, "the user's request never queued"
        time.sleep(0.05)
    # the daemon answers others while one connection waits for a slot
    t0 = time.monotonic()
    for _ in range(5):
        assert client.call("ping")["pong"] is True
    assert time.monotonic() - t0 < 2.0
    queued = client.call("slots.list")["waiters"]
    assert [q["holder"]["uid"] for q in queued] == [user_uid]
    assert queued[0]["holder"]["pid"] == waiter.pid
    released_at = time.time()
    access.release_slot(cfg, held.id)
    granted, granted_at, pid = waiter.result()
    assert granted["holder"] == {**granted["holder"], "pid": pid, "uid": user_uid}
    assert granted["gpus"] == [1] and granted_at >= released_at
    # the holder's process has exited: the next read reclaims its reservation
    assert SlotTable.from_config(cfg).reservations() == []


def test_timeout_comes_back_as_slot_timeout(cfg: Config, daemon: int, user_uid: int) -> None:
    held = access.reserve_slot(cfg, model="hog", units=4, allowed_gpus=[1], timeout_s=5)
    kind, message, _pid = as_user(user_uid, _wait_for_slot, cfg, 0.5)
    assert kind == "SlotTimeout", message
    assert "no slot for model waiter" in message and held.id in message
    assert Client(cfg).call("slots.list")["waiters"] == []


def test_killed_waiter_frees_its_place(cfg: Config, daemon: int, user_uid: int) -> None:
    held = access.reserve_slot(cfg, model="hog", units=4, allowed_gpus=[1], timeout_s=5)
    waiter = spawn_as(user_uid, _wait_for_slot, cfg, 30.0)
    client = Client(cfg)
    deadline = time.monotonic() + 10
    while not client.call("slots.list")["waiters"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(waiter.pid, 9)
    os.waitpid(waiter.pid, 0)
    os.close(waiter.rfd)
    access.release_slot(cfg, held.id)
    # root gets the GPU at once: the dead waiter neither holds it nor stays queued ahead
    t0 = time.monotonic()
    mine = access.reserve_slot(cfg, model="next", units=4, allowed_gpus=[1], timeout_s=5)
    assert time.monotonic() - t0 < 3.0
    assert mine.holder.pid == os.getpid()
    time.sleep(0.2)  # the daemon thread notices its requester is gone and dequeues
    assert client.call("slots.list")["waiters"] == []


def test_root_takes_back_world_writable_slot_files(cfg: Config) -> None:
    # what an earlier release left behind: 0777 directory, 0666 files
    cfg.paths.slots.mkdir(parents=True)
    os.chmod(cfg.paths.slots, 0o777)
    for name in ("state.json", "slots.lock"):
        (cfg.paths.slots / name).touch()
        os.chmod(cfg.paths.slots / name, 0o666)
    (cfg.paths.slots / "state.json").write_text('{"version": 1}')
    table = SlotTable.from_config(cfg)
    modes = {p.name: stat.S_IMODE(os.stat(p).st_mode)
             for p in (cfg.paths.slots, table.state_path, table.lock_path)}  # fmt: skip
    assert modes == {"slots": 0o755, "state.json": 0o644, "slots.lock": 0o600}


def _job_gpus_session(cfg: Config) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["other_gpu"] = outcome(access.reserve_slot, cfg, model="x", units=1, allowed_gpus=[0],
                               job_id="202", timeout_s=1)  # fmt: skip
    r = access.reserve_slot(cfg, model="x", units=4, job_id="202", timeout_s=5)
    out["gpus"] = list(r.gpus)
    access.release_slot(cfg, r.id)
    return out


def test_a_users_reservation_takes_only_the_gpus_of_its_job(
    cfg: Config, daemon: int, user_uid: int
) -> None:
    """A user may not queue for GPUs Slurm gave other jobs (the prolog records the job's)."""
    Client(cfg).call("job.register", job_id="202", uid=user_uid, user=TEST_USER, gpus=[1])
    out = as_user(user_uid, _job_gpus_session, cfg)
    assert out["other_gpu"].startswith("PermissionDenied: job 202 holds GPUs [1]"), out
    assert out["gpus"] == [1]  # a whole GPU: of the two free ones, the job's


def _jobless_session(cfg: Config) -> dict[str, Any]:
    os.environ.pop("SLURM_JOB_ID", None)
    out: dict[str, Any] = {}
    out["jobs_gpu"] = outcome(access.reserve_slot, cfg, model="x", units=1, allowed_gpus=[1],
                              timeout_s=1)  # fmt: skip
    r = access.reserve_slot(cfg, model="x", units=4, timeout_s=5)
    out["gpus"] = list(r.gpus)
    access.release_slot(cfg, r.id)
    return out


def _any_gpu(cfg: Config) -> str:
    os.environ.pop("SLURM_JOB_ID", None)
    return outcome(access.reserve_slot, cfg, model="x", units=1, timeout_s=1)


def test_a_users_reservation_outside_a_job_takes_no_gpu_a_job_holds(
    cfg: Config, daemon: int, user_uid: int
) -> None:
    """Outside a job a user may not queue for (and so hold back) the GPUs Slurm gave the
    node's jobs; before, any GPU could be taken (the refusal below was a reservation)."""
    Client(cfg).call("job.register", job_id="203", uid=0, user="root", gpus=[1])
    out = as_user(user_uid, _jobless_session, cfg)
    assert out["jobs_gpu"].startswith(
        "PermissionDenied: outside a job you may reserve only GPUs that no job of this node "
        "holds, and each of [1] is held (GPU 1: job 203); run it inside your job"), out  # fmt: skip
    assert out["gpus"] == [0]  # a whole GPU: the one no job holds
    Client(cfg).call("job.register", job_id="204", uid=0, user="root", gpus=[0])
    got = as_user(user_uid, _any_gpu, cfg)
    assert got.startswith("PermissionDenied: outside a job you may reserve only GPUs that no "
                          "job of this node holds, and every one is held (GPU 0: job 204, "
                          "GPU 1: job 203)"), got  # fmt: skip
    # root, outside a job too, is not bound by it (the prolog, an admin)
    r = access.reserve_slot(cfg, model="x", units=1, allowed_gpus=[1], timeout_s=5)
    access.release_slot(cfg, r.id)


def _wait_for(cond: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _hold_until_revoked(cfg: Config) -> dict[str, Any]:
    os.environ.pop("SLURM_JOB_ID", None)
    r = access.reserve_slot(cfg, model="mine", units=4, allowed_gpus=[0], timeout_s=5)
    table = SlotTable(cfg.paths.slots, [0, 1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # this process holds it all along: only a revoke ends it
        if r.id not in {x.id for x in table.reservations()}:
            return {"id": r.id, "revoked": True}
        time.sleep(0.05)
    return {"id": r.id, "revoked": False}


def test_a_job_given_a_gpu_takes_it_back_from_a_users_reservation_outside_a_job(
    cfg: Config, daemon: int, user_uid: int
) -> None:
    """A reservation a user's program made outside any job gives way to a job Slurm gives
    its GPU to (before, it stayed until the program ended and the job's own waited)."""
    table = SlotTable.from_config(cfg)
    child = spawn_as(user_uid, _hold_until_revoked, cfg)
    _wait_for(lambda: any(r.model == "mine" for r in table.reservations()), "the reservation")
    Client(cfg).call("job.register", job_id="205", uid=0, user="root", gpus=[0])
    out = child.result()
    assert out["revoked"] is True, out
    ev = [e for e in Client(cfg).call("events.tail", n=50) if e["kind"] == "slots.revoked"]
    assert len(ev) == 1 and ev[0]["uid"] == user_uid and ev[0]["job_id"] == "205", ev
    assert ev[0]["detail"]["reservation"] == out["id"], ev
    assert ev[0]["detail"]["reason"].startswith(
        "job 205 was given GPU(s) [0]; a user's reservation"
    ), ev
    # the job's own reservation is granted at once
    r = access.reserve_slot(cfg, model="job", units=4, allowed_gpus=[0], job_id="205",
                            timeout_s=2)  # fmt: skip
    access.release_slot(cfg, r.id)


def _wait_outside_a_job(cfg: Config, allowed: list[int] | None) -> str:
    os.environ.pop("SLURM_JOB_ID", None)
    try:
        r = access.reserve_slot(cfg, model="waits", units=4, allowed_gpus=allowed, timeout_s=15)
    except Exception as e:  # the refusal, as the test reads it
        return f"{type(e).__name__}: {e}"
    return f"granted {list(r.gpus)}"


def _user_waits_behind_root(cfg: Config, user_uid: int) -> tuple[SlotTable, list[Any], Any]:
    """Root holds both GPUs whole; the user waits outside a job for either."""
    table = SlotTable.from_config(cfg)
    held = [access.reserve_slot(cfg, model="root", units=4, allowed_gpus=[g], timeout_s=5)
            for g in (0, 1)]  # fmt: skip
    child = spawn_as(user_uid, _wait_outside_a_job, cfg, None)
    _wait_for(lambda: any(w.model == "waits" for w in table.waiters()), "the user's wait")
    return table, held, child


def test_a_users_wait_outside_a_job_is_judged_again_when_granted(
    cfg: Config, daemon: int, user_uid: int
) -> None:
    """A user's reservation outside a job, granted after a wait, takes no GPU a job was
    given meanwhile (before, it was judged only when asked: it took GPU 0 from job 206)."""
    table, held, child = _user_waits_behind_root(cfg, user_uid)
    Client(cfg).call("job.register", job_id="206", uid=0, user="root", gpus=[0])
    access.release_slot(cfg, held[0].id)
    time.sleep(0.5)  # GPU 0 is free, but a job's now: the user waits on for GPU 1
    assert [w.model for w in table.waiters()] == ["waits"]
    access.release_slot(cfg, held[1].id)
    assert child.result() == "granted [1]"

    # every GPU it waited for went to a job: the wait ends with the reason
    r = access.reserve_slot(cfg, model="root", units=4, allowed_gpus=[1], timeout_s=5)
    child = spawn_as(user_uid, _wait_outside_a_job, cfg, [1])
    _wait_for(lambda: any(w.model == "waits" for w in table.waiters()), "the user's wait")
    Client(cfg).call("job.register", job_id="207", uid=0, user="root", gpus=[1])
    got = child.result()
    assert got.startswith("PermissionDenied: while pid "), got
    assert ("waited for a slot outside a job, Slurm gave its GPU to a job (GPU 1: job 207); "
            "run it inside your job") in got  # fmt: skip
    access.release_slot(cfg, r.id)


def test_a_job_given_a_gpu_is_not_held_back_by_a_users_wait_outside_a_job(
    cfg: Config, daemon: int, user_uid: int
) -> None:
    """A user's place in line outside a job stops counting the GPUs a job is given
    (before, job 208's own reservation of its free GPU 0 waited behind it, and timed out)."""
    table, held, child = _user_waits_behind_root(cfg, user_uid)
    Client(cfg).call("job.register", job_id="208", uid=0, user="root", gpus=[0])
    access.release_slot(cfg, held[0].id)
    r = access.reserve_slot(cfg, model="job", units=4, allowed_gpus=[0], job_id="208",
                            timeout_s=2)  # fmt: skip
    assert r.gpus == (0,)
    access.release_slot(cfg, r.id)
    access.release_slot(cfg, held[1].id)
    assert child.result() == "granted [1]"
