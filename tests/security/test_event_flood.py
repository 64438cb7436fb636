"""One user cannot push everyone else's events out of the node's event log, nor make
spswapd read it whole: a user's text in an event has a bound, a user's events a rate,
and one events.tail request at most 1000 events. As the second uid, against a real
spswapd.

Before: a model name of 60 KB in slots.reserve/release made the log start a new file
every few seconds, and two of them lost every other event (the marker below); an
events.tail of n=10**12 parsed both files whole, each call ~190 MB of spswapd's memory.
"""

from __future__ import annotations

import os
from typing import Any

from spswap.config import Config
from spswap.daemon import events
from spswap.daemon.client import Client
from tests.security.conftest import outcome
from tests.uids import as_user


def _flood(cfg: Config, model_chars: int, pairs: int) -> dict[str, Any]:
    os.environ.pop("SLURM_JOB_ID", None)
    client = Client(cfg)
    got: dict[str, int] = {}
    for _ in range(pairs):
        try:
            r = client.call("slots.reserve", model="m" * model_chars, units=1, timeout_s=5)
            client.call("slots.release", reservation_id=r["id"])
            got["ok"] = got.get("ok", 0) + 1
        except Exception as e:  # noqa: BLE001 - what the flood gets back is the result
            key = type(e).__name__
            got[key] = got.get(key, 0) + 1
            got["message"] = str(e)[:200]  # type: ignore[assignment]
    return got


def test_a_user_cannot_flush_the_event_log(cfg: Config, daemon: int, user_uid: int) -> None:
    Client(cfg).call("job.register", job_id="900", uid=0, user="root")  # the marker
    big = as_user(user_uid, _flood, cfg, 60_000, 1200)
    assert big.get("ProtocolError") == 1200, big
    assert big["message"].startswith("argument 'model' of slots.reserve must be text of at "
                                      "most 256 characters, got 'mmmm"), big  # fmt: skip
    small = as_user(user_uid, _flood, cfg, 256, 400)
    assert small == {"ok": 400}, small  # served, only fewer of its events written
    path = cfg.paths.events
    kept = events.tail(path, 100_000)
    assert any(e["kind"] == "job.start" and e["job_id"] == "900" for e in kept)
    theirs = [e for e in kept if e.get("uid") == user_uid]
    assert 0 < len(theirs) < 800 and sum(len(events.format_event(e)) for e in theirs) < 80_000
    assert not events.rotated(path).exists()


def test_one_tail_reads_at_most_a_thousand_events(cfg: Config, daemon: int) -> None:
    for i in range(1500):
        events.append(cfg.paths.events, "filler", i=i)
    got = Client(cfg).call("events.tail", n=10**12)
    assert len(got) == 1000 and got[-1]["detail"] == {"i": 1499}
    assert outcome(Client(cfg).call, "events.tail", n=-5) == "ok"
