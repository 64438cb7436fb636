"""Image identity, meta.json and the check before a restore, on real files."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from spswap.checkpoint import criu, images
from spswap.checkpoint.images import Identity

from .criu_helpers import Server, needs_criu

ID = Identity(
    engine="vllm", engine_version="0.26.0", torch="2.11.0", python="3.11.7",
    driver="580.159.04", gpu_model="NVIDIA H200", criu_version="4.1.1",
    model_digest="ab" * 32, uid=1000, config_hash=images.config_hash({"tp": 1, "eager": True}),
)  # fmt: skip


def _image(tmp_path: Path) -> Path:
    d = tmp_path / "img"
    d.mkdir(mode=0o700)
    (d / "pages-1.img").write_bytes(os.urandom(3000))
    (d / "core-1.img").write_bytes(b"core")
    (d / "dump.log").write_text("Dumping finished successfully\n")
    return d


def test_key_and_hashes() -> None:
    assert images.config_hash({"eager": True, "tp": 1}) == ID.config_hash  # key order irrelevant
    key = images.image_key(ID)
    assert key == f"{'ab' * 8}-{ID.config_hash[:8]}-{ID.hash()[:8]}"
    # The identity hash leaves model and config out (they have their own parts of the key) ...
    assert dataclasses.replace(ID, model_digest="cd" * 32).hash() == ID.hash()
    # ... and changes with anything else.
    assert dataclasses.replace(ID, driver="580.1").hash() != ID.hash()
    assert images.image_key(dataclasses.replace(ID, uid=1001)) != key
    assert Identity.from_json(ID.to_json()) == ID


def test_meta_round_trip_and_verify(tmp_path: Path) -> None:
    d = _image(tmp_path)
    meta = images.write_meta(d, ID)
    assert images.read_meta(d) == meta and meta["identity"]["uid"] == 1000
    assert images.verify_before_restore(d, ID) is None
    (d / "dump.log").write_text("logs are not part of the image\n")
    assert images.verify_before_restore(d, ID) is None


def test_verify_names_every_difference(tmp_path: Path) -> None:
    d = _image(tmp_path)
    images.write_meta(d, ID)
    other = dataclasses.replace(ID, driver="580.200.01", uid=1001)
    reason = images.verify_before_restore(d, other)
    assert reason is not None
    assert "driver: image '580.159.04', here '580.200.01'" in reason
    assert "uid: image 1000, here 1001" in reason and "torch" not in reason


def test_verify_finds_tampering_and_missing_meta(tmp_path: Path) -> None:
    d = _image(tmp_path)
    images.write_meta(d, ID)
    with open(d / "pages-1.img", "r+b") as f:
        f.write(b"X")
    reason = images.verify_before_restore(d, ID)
    assert reason is not None and "changed since it was dumped" in reason
    assert images.verify_before_restore(d, ID, check_integrity=False) is None
    (d / "meta.json").unlink()
    assert "no meta.json" in (images.verify_before_restore(d, ID) or "")
    assert "no image" in (images.verify_before_restore(tmp_path / "nope", ID) or "")


@pytest.mark.skipif(os.geteuid() != 0, reason="ownership check applies to the root daemon")
def test_verify_refuses_an_image_others_can_write(tmp_path: Path) -> None:
    d = _image(tmp_path)
    images.write_meta(d, ID)
    d.chmod(0o777)
    assert "writable by others" in (images.verify_before_restore(d, ID) or "")
    d.chmod(0o700)
    os.chown(d, 1000, 1000)
    assert "not owned by root" in (images.verify_before_restore(d, ID) or "")


def test_probe_identity() -> None:
    ident = images.probe_identity(
        engine="torch-ref", engine_version="1", model_digest="ef" * 32,
        engine_config={"dtype": "float32"}, uid=os.getuid(), gpu_model="none",
        driver="none", criu_version="4.1.1",
    )  # fmt: skip
    assert ident.python.count(".") == 2 and ident.torch != ""
    assert ident.config_hash == images.config_hash({"dtype": "float32"})


@pytest.mark.criu
@needs_criu
def test_meta_on_a_real_criu_image(server: Server, tmp_path: Path) -> None:
    info = criu.dump(server.pid, "real", tmp_path / "images")
    images.write_meta(info.path, ID)
    assert images.verify_before_restore(info.path, ID) is None
    assert criu.restore("real", tmp_path / "images") == server.pid
    assert server.ask().split()[1] == "1"


def test_integrity_hash_is_the_same_on_any_number_of_threads(tmp_path):
    from spswap.checkpoint.images import PIECE_BYTES, integrity_hash

    (tmp_path / "pages-1.img").write_bytes(bytes(range(256)) * (PIECE_BYTES // 128 + 3))
    (tmp_path / "core.img").write_bytes(b"core")
    (tmp_path / "empty.img").write_bytes(b"")
    hashes = {integrity_hash(tmp_path, threads=n) for n in (1, 2, 5)}
    assert len(hashes) == 1
    with open(tmp_path / "pages-1.img", "r+b") as f:  # one byte in the second piece
        f.seek(PIECE_BYTES + 7)
        f.write(b"\xff")
    assert integrity_hash(tmp_path, threads=3) not in hashes


def test_credentials_problem_refuses_other_uids_and_capabilities(tmp_path, monkeypatch):
    import spswap.checkpoint.credentials as credentials
    from spswap.checkpoint.credentials import credentials_problem

    monkeypatch.setattr(credentials, "user_groups", lambda uid: None)  # groups: next test

    def proc(pid, uid, cap="0000000000000000"):
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "status").write_text(
            f"Name:\tx\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n"
            f"Gid:\t100\t100\t100\t100\nCapEff:\t{cap}\n"
        )

    proc(10, 1000)
    proc(11, 1000)
    assert credentials_problem([10, 11, 99], 1000, proc=tmp_path) is None  # 99: gone
    (tmp_path / "12").mkdir()
    (tmp_path / "12" / "status").write_text("Uid:\t1000\t0\t0\t0\nCapEff:\t0\n")  # setuid
    assert "uids [0, 1000]" in credentials_problem([10, 12], 1000, proc=tmp_path)
    proc(13, 1000, cap="0000000000003000")
    assert "capabilities" in credentials_problem([13], 1000, proc=tmp_path)
    proc(14, 0, cap="000001ffffffffff")
    assert credentials_problem([14], 0, proc=tmp_path) is None  # root's own job
    (tmp_path / "15").mkdir()
    (tmp_path / "15" / "status").write_text(  # setgid: effective group 5 (tty, say)
        "Uid:\t1000\t1000\t1000\t1000\nGid:\t100\t5\t5\t5\nCapEff:\t0\n"
    )
    assert "several gids [5, 100]" in credentials_problem([10, 15], 1000, proc=tmp_path)


def test_credentials_problem_wants_the_users_own_groups(tmp_path, monkeypatch):
    """A setgid helper that set all four gids to its group is still refused."""
    import spswap.checkpoint.credentials as credentials

    real = credentials.user_groups
    assert real(0) is not None and 0 in real(0)  # root is in its own group
    monkeypatch.setattr(credentials, "user_groups", lambda uid: {100, 27} if uid == 1000 else None)
    for pid, gid in ((20, 100), (21, 27), (22, 5)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "status").write_text(
            f"Uid:\t1000\t1000\t1000\t1000\nGid:\t{gid}\t{gid}\t{gid}\t{gid}\nCapEff:\t0\n"
        )
    assert credentials.credentials_problem([20, 21], 1000, proc=tmp_path) is None
    assert "gid [5], not a group of uid 1000" in credentials.credentials_problem(
        [22], 1000, proc=tmp_path
    )


def test_image_job_ids_give_het_jobs_their_real_id(tmp_path):
    from spswap.checkpoint.service import image_job_ids, job_prefix

    images, statuses = tmp_path / "images", tmp_path / "checkpoints"
    statuses.mkdir()
    for job in ("123+0", "77"):
        (images / f"{job_prefix(job)}aa-bb-cc").mkdir(parents=True)
    (statuses / "123+0.json").write_text('{"job_id": "123+0", "state": "saved"}')
    assert image_job_ids(images, statuses) == ["123+0", "77"]
    assert image_job_ids(images) == ["123_0", "77"]  # without the status files: the key


def test_an_image_needs_each_pool_entry_its_digest_names() -> None:
    from spswap.checkpoint.images import DIGEST_SEP, pool_digests

    assert pool_digests("ab12") == ["ab12"]
    assert pool_digests(DIGEST_SEP.join(["ab12", "cd34", "ef56"])) == ["ab12", "cd34", "ef56"]
    assert pool_digests("") == []


def test_the_quick_check_sees_a_file_missing_added_or_cut_but_not_a_byte_changed(
    tmp_path: Path,
) -> None:
    d = _image(tmp_path)
    images.write_meta(d, ID)
    assert images.verify_before_restore(d, ID, read_content=False) is None
    with open(d / "pages-1.img", "r+b") as f:
        f.write(b"X")  # in place, same size: only the full check reads it
    assert images.verify_before_restore(d, ID, read_content=False) is None
    assert "changed since it was dumped" in (images.verify_before_restore(d, ID) or "")
    (d / "extra.img").write_bytes(b"1")
    assert "a file is missing, added or of another size" in (
        images.verify_before_restore(d, ID, read_content=False) or "")  # fmt: skip
    (d / "extra.img").unlink()
    with open(d / "pages-1.img", "r+b") as f:
        f.truncate(1)
    assert "of another size" in (images.verify_before_restore(d, ID, read_content=False) or "")


def test_an_image_recorded_without_a_layout_is_read_whole(tmp_path: Path) -> None:
    import json

    d = _image(tmp_path)
    meta = images.write_meta(d, ID)
    del meta["layout"]
    (d / "meta.json").write_text(json.dumps(meta))
    with open(d / "pages-1.img", "r+b") as f:
        f.write(b"X")
    assert "changed since" in (images.verify_before_restore(d, ID, read_content=False) or "")


def test_what_a_restore_would_refuse_whatever_the_job_is_seen_without_reading(
    tmp_path: Path,
) -> None:
    """`spswap images ls`: an image without its record, or whose files changed in name or
    size, is one a restore refuses; a whole one is not (no byte is hashed for this)."""
    from spswap.cli.images import collect_images, refused_lines

    root = tmp_path / "images"
    root.mkdir()
    whole = _image(root)
    images.write_meta(whole, ID)
    whole = whole.rename(root / "job7-whole")
    bare = root / "job9-bare"
    bare.mkdir(mode=0o700)
    (bare / "pages-1.img").write_bytes(b"x")
    assert images.files_problem(whole) is None
    assert images.files_problem(bare) == f"{bare} has no meta.json: not a complete spswap image"
    listed = {i["job_id"]: i for i in collect_images(root, tmp_path / "statuses")}
    assert (listed["7"]["state"], listed["7"]["problem"]) == ("unknown", None)
    assert listed["9"]["state"] == "refused"
    assert refused_lines(list(listed.values())) == [
        f"job 9: {bare} has no meta.json: not a complete spswap image; a restore refuses it "
        "(and deletes it), or `spswap images rm 9` now"]  # fmt: skip
    # a name that holds no job (spswap never makes one): deleted by hand
    odd = {"job_id": "", "key": "odd", "path": "/i/odd", "problem": "P"}
    assert refused_lines([odd]) == ["job odd: P; a restore refuses it (and deletes it), or "
                                    "`rm -r /i/odd` now"]  # fmt: skip
    (whole / "pages-2.img").write_bytes(b"added")
    assert images.files_problem(whole) == (
        f"{whole} changed since it was dumped (a file is missing, added or of another size)"
    )
