"""spswapd's start finishes the image deletions a dead daemon left undone: an image moved
aside after its restore (``.gone-``) whose freeing thread died with the daemon."""

from __future__ import annotations

from pathlib import Path

from spswap.checkpoint import criu, link_remap
from spswap.config import Config
from spswap.daemon import ckpt_recover, lifecycle
from spswap.daemon.state import DaemonState
from spswap.fsutil import atomic_write_json


def test_start_up_frees_what_a_dead_daemon_was_deleting(tmp_path: Path) -> None:
    cfg = Config.from_env({}, root=tmp_path / "root")
    lifecycle.prepare_dirs(cfg)
    st = DaemonState(cfg)
    shm = tmp_path / "shm"
    shm.mkdir()
    # died between the rename and the meta's unlink: the links are still its to discard
    gone = cfg.paths.images / f"{criu.GONE_PREFIX}job7-m-abc-1a2b3c4d"
    gone.mkdir(parents=True)
    (gone / "pages-1.img").write_bytes(b"\0" * 4096)
    parked = shm / f"{link_remap.PARKED_PREFIX}job7-m-abc-1"
    parked.write_text("sem")
    atomic_write_json(gone / criu.DUMP_META, {"link_remaps": [
        {"dir": str(shm), "name": "link_remap.1", "parked": parked.name}]})  # fmt: skip
    ckpt_recover.recover(st)
    assert not gone.exists() and not parked.exists()
    assert list(cfg.paths.images.iterdir()) == []
