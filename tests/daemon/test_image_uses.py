"""spswapd's pool uses for checkpoint images (spswap.daemon.image_uses) say whose image
each holds its entry for: a user whose share is full is told which job's image keeps
their entry (it said 'pid P uid 0', spswapd's own)."""

from __future__ import annotations

from pathlib import Path

from spswap.checkpoint.images import META_FILE
from spswap.config import Config
from spswap.daemon import lifecycle
from spswap.daemon.image_uses import sync_image_uses
from spswap.daemon.state import DaemonState
from spswap.fsutil import atomic_write_json
from spswap.pool.store import Pool
from tests.pool.st_files import tensors, write_st


def _image(cfg: Config, key: str, digest: str) -> None:
    image = cfg.paths.images / key
    image.mkdir(parents=True)
    atomic_write_json(image / META_FILE, {"identity": {"model_digest": digest}})


def test_each_image_use_names_its_job(tmp_path: Path) -> None:
    cfg = Config.from_env({"SPSWAP_GPUS": "0"}, root=tmp_path / "root")
    lifecycle.prepare_dirs(cfg)
    pool = Pool.from_config(cfg)
    m = pool.import_checkpoint(write_st(tmp_path / "m.safetensors", tensors(1)), name="m")
    _image(cfg, "job1086-aaaa-bbbb-cccc", m.digest)
    _image(cfg, "job1090-aaaa-bbbb-dddd", m.digest)
    st = DaemonState(cfg)
    st.dumping.hold("1091", m.digest)
    assert sync_image_uses(st) == {m.digest: 3}
    (entry,) = pool.entries()
    assert sorted(h.describe() for h in entry.users) == [
        f"spswapd, for job {j}'s checkpoint image (until that job runs again, or ends)"
        for j in ("1086", "1090", "1091")
    ]
    # the image of job 1090 goes, and the dump of 1091 ends: their uses go, 1086's stays
    for p in (cfg.paths.images / "job1090-aaaa-bbbb-dddd").iterdir():
        p.unlink()
    (cfg.paths.images / "job1090-aaaa-bbbb-dddd").rmdir()
    st.dumping.end("1091")
    assert sync_image_uses(st) == {m.digest: 1}
    assert [h.for_job for h in pool.entries()[0].users] == ["1086"]
    assert sync_image_uses(st) == {m.digest: 1}  # (stable: nothing taken or given twice)
    assert len(pool.entries()[0].users) == 1
