"""Authorization with two real uids: root and a system user created for the test."""

from __future__ import annotations

import os

import pytest

from spswap import access
from spswap.config import Config
from spswap.daemon.client import Client
from spswap.liveness import Holder
from spswap.slots.table import SlotTable
from tests.uids import TEST_USER, as_user

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a second uid")


@pytest.fixture(autouse=True)
def _daemon_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    # autouse fixtures come first, so the daemon started by `daemon` inherits it
    monkeypatch.setenv("SPSWAP_GPUS", "0")


def _steps(cfg: Config, steps: list) -> list[str]:
    out = []
    for op, args in steps:
        if op == "reserve-own":  # a reservation of this process, through the socket both ways
            r = access.reserve_slot(cfg, model="mine", units=1, allowed_gpus=[0], timeout_s=5)
            assert (r.holder.pid, r.holder.uid) == (os.getpid(), os.getuid())
            op, args = "slots.release", {"reservation_id": r.id}
        try:
            Client(cfg).call(op, **args)
            out.append("ok")
        except Exception as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def run_as_user(cfg: Config, steps: list, uid: int) -> list[str]:
    """Run ``steps`` as ``uid`` (a forked child that dropped root)."""
    result: list[str] = as_user(uid, _steps, cfg, steps)
    return result


IDENT = {
    "engine": "reference",
    "engine_version": "0",
    "torch": "0",
    "python": "3",
    "model_digest": "ab" * 32,
    "config_hash": "cd" * 32,
}


def test_user_acts_only_on_own(cfg: Config, daemon: int, user_uid: int) -> None:
    root = Client(cfg)
    root.call("job.register", job_id="100", uid=0, user="root")
    root.call("job.register", job_id="200", uid=user_uid, user=TEST_USER)
    table = SlotTable(cfg.paths.slots, [0])
    rootres = table.reserve(model="root-model", units=2, holder=Holder.current(), timeout_s=5)
    image = cfg.paths.images / "job200-aaaa-bbbb"  # the user's own job's image
    image.mkdir(parents=True)

    out = run_as_user(cfg, [
        ["slots.release", {"reservation_id": rootres.id}],
        ["checkpoint", {"job_id": "100", **IDENT}],
        ["restore", {"job_id": "100", **IDENT}],
        ["checkpoint", {"job_id": "200", "pid": 1, **IDENT}],
        ["reserve-own", {}],
        ["job.register", {"job_id": "300", "uid": user_uid}],
        ["job.end", {"job_id": "100"}],
        ["ping", {}],
        ["slots.list", {}],
        ["job.starting", {"job_id": "100"}],
        ["job.starting", {"job_id": "200"}],
        ["images.remove", {"job_id": "200"}],
    ], user_uid)  # fmt: skip
    assert out[0].startswith("PermissionDenied: ") and f"uid {user_uid}" in out[0], out[0]
    assert out[1].startswith("PermissionDenied: job 100 belongs to uid 0"), out[1]
    assert out[2].startswith("PermissionDenied: job 100 belongs to uid 0"), out[2]
    # its own job passes authorization, but a user may checkpoint only itself
    assert out[3] == (
        "PermissionDenied: a user may checkpoint only the calling process itself: leave out pid"
    )
    assert out[4] == "ok"
    assert out[5].startswith("PermissionDenied: job.register is for the Slurm prolog/epilog")
    assert out[6].startswith("PermissionDenied: job.end is for the Slurm prolog/epilog")
    assert out[7:9] == ["ok", "ok"]
    # a run's start wakes only the caller's own job's kept instance
    assert out[9].startswith("PermissionDenied: job 100 belongs to uid 0"), out[9]
    assert out[10] == "ok"
    # only root deletes images, a user's own job's too (spswapd accounts for them)
    assert out[11] == ("PermissionDenied: images.remove is for root (`spswap images rm`) only; "
                       f"you are uid {user_uid}")  # fmt: skip
    assert image.is_dir()
    # root's reservation and job are untouched; root may release anyone's
    assert [r.id for r in table.reservations()] == [rootres.id]
    assert {j["job_id"]: j["state"] for j in root.call("jobs.list")} == {
        "100": "running",
        "200": "running",
    }
    root.call("slots.release", reservation_id=rootres.id)
    assert table.reservations() == []
