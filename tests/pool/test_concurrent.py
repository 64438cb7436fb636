"""Several real processes importing at once end up with one entry and one digest."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from spswap.pool.store import Pool

from .st_files import spawn_python, write_sharded, write_st

IMPORT = """
import json, sys, time
from pathlib import Path
from spswap.pool.store import Pool
start = float(sys.argv[3])
while time.time() < start:
    time.sleep(0.001)
m = Pool(Path(sys.argv[1]), capacity_bytes=1 << 30).import_checkpoint(Path(sys.argv[2]))
print(json.dumps({"digest": m.digest, "created": m.created}), flush=True)
"""


def _run_all(pool_dir: Path, paths: list[Path]) -> list[dict]:
    import time

    start = str(time.time() + 1.0)  # all processes begin together, after Python starts
    procs = [spawn_python(IMPORT, str(pool_dir), str(p), start) for p in paths]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    return results


def _big_arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.standard_normal((1024, 1024 + i)).astype(np.float32) for i in range(6)}


def test_three_processes_import_same_file(tmp_path: Path) -> None:
    src = write_st(tmp_path / "model.safetensors", _big_arrays(0))
    pool_dir = tmp_path / "pool"
    results = _run_all(pool_dir, [src] * 3)
    assert len({r["digest"] for r in results}) == 1
    # One writer: every process saw the very same entry (same creation time).
    assert len({r["created"] for r in results}) == 1
    pool = Pool(pool_dir)
    assert [e.manifest.digest for e in pool.entries()] == [results[0]["digest"]]
    assert sorted(p.name for p in pool_dir.iterdir()) == sorted(
        [".locks", "index.json", results[0]["digest"]]
    )
    pool.verify(results[0]["digest"])


def test_same_content_two_paths_concurrently(tmp_path: Path) -> None:
    arrays = _big_arrays(1)
    a = write_st(tmp_path / "a.safetensors", arrays)
    names = list(arrays)
    b = write_sharded(
        tmp_path / "b", [{k: arrays[k] for k in names[:3]}, {k: arrays[k] for k in names[3:]}]
    )
    results = _run_all(tmp_path / "pool", [a, b, a])
    assert len({r["digest"] for r in results}) == 1
    entries = Pool(tmp_path / "pool").entries()
    assert len(entries) == 1
    assert not [p for p in (tmp_path / "pool").iterdir() if p.name.startswith(".tmp-")]
