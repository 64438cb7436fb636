"""Importing checkpoints into a real pool directory: layout, bytes, reuse, bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from spswap.errors import InvalidCheckpoint
from spswap.pool.layout import DATA_FILE, MANIFEST_FILE
from spswap.pool.manifest import ALIGNMENT_BYTES, Manifest
from spswap.pool.store import Pool

from .st_files import header_and_data, pool_snapshot, tensors, write_raw, write_sharded, write_st


@pytest.fixture
def pool(tmp_path: Path) -> Pool:
    return Pool(tmp_path / "root" / "pool", capacity_bytes=64 << 20)


def _assert_entry_holds(pool: Pool, m: Manifest, arrays: dict[str, np.ndarray]) -> None:
    data = pool.data_path(m).read_bytes()
    assert len(data) == m.data_size_bytes and m.data_size_bytes % ALIGNMENT_BYTES == 0
    assert {t.name for t in m.tensors} == set(arrays)
    for t in m.tensors:
        assert t.offset % ALIGNMENT_BYTES == 0
        assert t.shape == arrays[t.name].shape
        assert data[t.offset : t.offset + t.size_bytes] == arrays[t.name].tobytes()
    assert sorted(p.name for p in pool.entry_dir(m.digest).iterdir()) == [DATA_FILE, MANIFEST_FILE]
    on_disk = json.loads((pool.entry_dir(m.digest) / MANIFEST_FILE).read_text())
    assert Manifest.from_json(on_disk) == m


def test_import_single_file(pool: Pool, tmp_path: Path) -> None:
    arrays = tensors()
    save_file(arrays, str(tmp_path / "tiny.safetensors"))
    m = pool.import_checkpoint(tmp_path / "tiny.safetensors")
    assert m.name == "tiny"
    assert [s.path for s in m.sources] == [str(tmp_path / "tiny.safetensors")]
    _assert_entry_holds(pool, m, arrays)
    assert oct(pool.entry_dir(m.digest).stat().st_mode & 0o777) == "0o755"
    assert oct(pool.data_path(m).stat().st_mode & 0o777) == "0o644"
    assert [e.manifest for e in pool.entries()] == [m]
    pool.verify(m.name)


def test_import_sharded(pool: Pool, tmp_path: Path) -> None:
    arrays = tensors(scale=3)
    names = list(arrays)
    sh = write_sharded(
        tmp_path / "my-model",
        [{k: arrays[k] for k in names[:3]}, {k: arrays[k] for k in names[3:]}],
    )
    m = pool.import_checkpoint(sh, name="custom")
    assert m.name == "custom" and len(m.sources) == 3
    _assert_entry_holds(pool, m, arrays)


def test_same_content_from_another_path_keeps_existing(pool: Pool, tmp_path: Path) -> None:
    arrays = tensors()
    a = write_st(tmp_path / "a.safetensors", arrays)
    m1 = pool.import_checkpoint(a)
    (tmp_path / "b").mkdir()
    save_file(arrays, str(tmp_path / "b" / "model.safetensors"))
    m2 = pool.import_checkpoint(tmp_path / "b")
    assert m2 == m1 and len(pool.entries()) == 1
    assert pool.find_by_sources(pool.find(m1.digest).sources) == m1


def test_reimport_unchanged_source_reads_no_data(pool: Pool, tmp_path: Path) -> None:
    arrays = tensors()
    p = write_st(tmp_path / "m.safetensors", arrays)
    m1 = pool.import_checkpoint(p)
    # Overwrite the data with other bytes but keep size and mtime: a reuse that read the
    # data would notice; one that trusts (path, size, mtime) returns the old entry.
    st = p.stat()
    header, data = header_and_data(
        {k: v + 1 if v.dtype != np.int64 else v for k, v in arrays.items()}
    )
    write_raw(p, header, data)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    before = pool_snapshot(pool.pool_dir)
    seen: list[tuple[int, int]] = []
    m2 = pool.import_checkpoint(p, progress=lambda d, t: seen.append((d, t)))
    assert m2 == m1 and seen == []
    assert pool_snapshot(pool.pool_dir)[0] == before[0]  # no temp dir, no new entry
    # A touched file (new mtime) is imported again and gives the new content.
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    m3 = pool.import_checkpoint(p)
    assert m3.digest != m1.digest and len(pool.entries()) == 2


def test_progress_reports_total(pool: Pool, tmp_path: Path) -> None:
    arrays = tensors(scale=50)
    p = write_st(tmp_path / "m.safetensors", arrays)
    seen: list[tuple[int, int]] = []
    m = pool.import_checkpoint(p, progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (m.tensor_bytes, m.tensor_bytes)
    assert all(d <= t for d, t in seen)


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    arrays = tensors()
    header, data = header_and_data(arrays)
    out: dict[str, tuple[Path, str]] = {}
    out["missing"] = (tmp_path / "nope.safetensors", "no such file")
    (tmp_path / "random.safetensors").write_bytes(np.random.default_rng(0).bytes(10000))
    out["random"] = (tmp_path / "random.safetensors", "not a safetensors file")
    (tmp_path / "text.txt").write_text("just some text that is long enough\n" * 10)
    out["text"] = (tmp_path / "text.txt", "not a safetensors file")
    p = write_raw(tmp_path / "trunc.safetensors", header, data)
    p.write_bytes(p.read_bytes()[: -len(data) // 2])
    out["truncated"] = (p, "truncated")
    lie = json.loads(json.dumps(header))
    lie["embed.weight"]["data_offsets"][1] += 4
    out["size_lie"] = (write_raw(tmp_path / "lie.safetensors", lie, data), "the header lies")
    beyond = json.loads(json.dumps(header))
    beyond["step"]["data_offsets"] = [len(data) + 100, len(data) + 108]
    out["beyond"] = (write_raw(tmp_path / "beyond.safetensors", beyond, data), "holds only")
    overlap = json.loads(json.dumps(header))
    first = overlap["embed.weight"]["data_offsets"][0]
    overlap["step"]["data_offsets"] = [first, first + 8]
    out["overlap"] = (write_raw(tmp_path / "overlap.safetensors", overlap, data), "overlap")
    dtype = json.loads(json.dumps(header))
    dtype["step"]["dtype"] = "C64"
    out["dtype"] = (write_raw(tmp_path / "dtype.safetensors", dtype, data), "unknown dtype")
    return out


@pytest.mark.parametrize(
    "case", ["missing", "random", "text", "truncated", "size_lie", "beyond", "overlap", "dtype"]
)
@pytest.mark.parametrize("pool_has_entry", [False, True])
def test_bad_input_leaves_pool_as_it_was(
    pool: Pool, tmp_path: Path, case: str, pool_has_entry: bool
) -> None:
    if pool_has_entry:
        pool.import_checkpoint(write_st(tmp_path / "good.safetensors", tensors(5)))
    before = pool_snapshot(pool.pool_dir)
    path, message = _bad_inputs(tmp_path)[case]
    with pytest.raises(InvalidCheckpoint, match=message) as e:
        pool.import_checkpoint(path)
    assert str(path.name) in str(e.value)
    assert pool_snapshot(pool.pool_dir) == before


def test_failure_while_copying_removes_temp_dir(pool: Pool, tmp_path: Path) -> None:
    """A file cut short after its header was read: the copy fails, nothing stays behind."""
    import spswap.pool.importer as importer

    p = write_st(tmp_path / "m.safetensors", tensors(scale=20))
    pool.import_checkpoint(write_st(tmp_path / "good.safetensors", tensors(5)))
    before = pool_snapshot(pool.pool_dir)
    real = importer.resolve_checkpoint

    def resolve_then_truncate(path: Path):  # the file shrinks between header and data
        ckpt = real(path)
        p.write_bytes(p.read_bytes()[:-5000])
        return ckpt

    importer.resolve_checkpoint = resolve_then_truncate
    try:
        with pytest.raises(InvalidCheckpoint, match="truncated while importing"):
            pool.import_checkpoint(p)
    finally:
        importer.resolve_checkpoint = real
    assert pool_snapshot(pool.pool_dir) == before


def test_stale_temp_dir_of_dead_process_is_removed(pool: Pool, tmp_path: Path) -> None:
    pool.ensure_dirs()
    stale = pool.pool_dir / ".tmp-999999999-1-deadbeef"
    stale.mkdir()
    (stale / DATA_FILE).write_bytes(b"x" * 10)
    pool.import_checkpoint(write_st(tmp_path / "m.safetensors", tensors()))
    assert not stale.exists()


def test_writer_from_buffers_and_abort(pool: Pool) -> None:
    a = np.arange(1000, dtype=np.float32)
    with pool.writer("exported", identity={"engine": "test"}, expected_size_bytes=a.nbytes) as w:
        w.add("a", "F32", a.shape, a)
        w.add("b", "U8", (3,), memoryview(b"xyz"))
    assert w.manifest is not None and w.manifest.identity == {"engine": "test"}
    data = pool.data_path(w.manifest).read_bytes()
    assert data[w.manifest.by_name()["b"].offset :][:3] == b"xyz"
    before = pool_snapshot(pool.pool_dir)
    with pytest.raises(RuntimeError), pool.writer("broken") as w2:
        w2.add("a", "F32", a.shape, a)
        raise RuntimeError("engine died")
    assert pool_snapshot(pool.pool_dir) == before
