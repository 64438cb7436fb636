"""A running spswapd's periodic sweep removes its own freeze holds left empty: a release
whose tree was still leaving after its wait left ``spswap-parked-<tag>-hold-*`` behind,
and only a later start of a daemon of the same root took it (test roots never start
again: one leaked per CI run, 2026-12-07). Real cgroups: root, a cgroup v2 hierarchy."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from spswap.checkpoint import cgroups
from spswap.checkpoint.freeze_hold import EMPTY_STALE_S, hold_name
from spswap.config import Config
from spswap.daemon import events, lifecycle
from spswap.daemon.state import DaemonState
from spswap.daemon.sweeper import Sweeper


def test_the_periodic_sweep_removes_the_daemons_own_empty_holds(tmp_path: Path) -> None:
    own = cgroups.own_dirs(cgroups.mounts()).get("")
    if os.geteuid() != 0 or own is None:
        pytest.skip("needs root and a cgroup v2 hierarchy (as spswapd has)")
    cfg = Config.from_env({}, root=tmp_path / "root")
    lifecycle.prepare_dirs(cfg)
    st = DaemonState(cfg)
    tag = cgroups.root_tag(cfg.root)
    made = []
    try:
        for token, age_s in (("0badcafe", 2 * EMPTY_STALE_S), ("0c0ffee0", 0.0)):
            top = own / hold_name(tag, token)
            try:
                (top / "tree").mkdir(parents=True)
            except OSError as e:
                pytest.skip(f"cannot make a cgroup here: {e}")
            made.append(top)
            then_s = time.time() - age_s
            os.utime(top, (then_s, then_s))
        Sweeper(st, 30.0).sweep_once()
        left, new = made
        assert not left.exists()  # empty and made a while ago: gone
        assert new.exists()  # one being made right now: kept
        said = [e for e in events.tail(cfg.paths.events) if e["kind"] == "checkpoint.holds_swept"]
        assert said and said[-1]["detail"]["cgroups"] == [str(left)]
    finally:
        for top in made:
            for d in (top / "tree", top):
                if d.exists():
                    d.rmdir()
