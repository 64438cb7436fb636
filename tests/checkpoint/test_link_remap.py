"""CRIU's link_remap names without CRIU: setting other files aside, and an image whose
link stayed under CRIU's name (the real-CRIU runs are in test_criu_real)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spswap.checkpoint import link_remap
from spswap.errors import CheckpointFailed


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    """A /dev/shm stand-in: root's, world-writable and sticky, under root's directories."""
    if os.geteuid() != 0:
        pytest.skip("needs root (the renames happen only in root's directories)")
    d = tmp_path / "shm"
    d.mkdir()
    os.chmod(d, 0o1777)
    return d


def test_set_aside_moves_others_names_and_puts_them_back(shm: Path) -> None:
    for n in (1, 2, 3):
        (shm / f"link_remap.{n}").write_text(str(n))
    (shm / "sem.x").write_text("x")
    own = os.stat(shm / "link_remap.2")
    moved: list[tuple[str, str]] = []
    link_remap.set_aside([str(shm)], moved, keep=frozenset({(own.st_dev, own.st_ino)}))
    names = sorted(p.name for p in shm.iterdir())
    assert "link_remap.1" not in names and "link_remap.3" not in names
    assert "link_remap.2" in names and "sem.x" in names  # the image's own, and others
    assert sorted(original for _, original in moved) == [str(shm / "link_remap.1"),
                                                        str(shm / "link_remap.3")]  # fmt: skip
    (shm / "link_remap.3").write_text("new")  # the name was taken meanwhile
    left = link_remap.put_back(moved)
    assert (shm / "link_remap.1").read_text() == "1"
    assert (shm / "link_remap.3").read_text() == "new"  # never replaced
    assert len(left) == 1 and Path(left[0]).read_text() == "3"


def test_no_renames_where_a_user_could_swap_the_directory(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another uid")
    user_dir = tmp_path / "u"
    user_dir.mkdir()
    os.chown(user_dir, 4242, 4242)
    (user_dir / "link_remap.1").write_text("")
    open_dir = tmp_path / "open"  # root's, but anyone may rename in it (no sticky bit)
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    (open_dir / "link_remap.1").write_text("")
    moved: list[tuple[str, str]] = []
    link_remap.set_aside([str(user_dir), str(open_dir)], moved)
    assert moved == [] and (user_dir / "link_remap.1").exists()


def test_a_link_left_under_criu_s_name_restores_from_there(shm: Path) -> None:
    path = shm / "link_remap.4"
    path.write_text("sem")
    st = os.stat(path)
    record = {"dir": str(shm), "name": "link_remap.4", "parked": None,
              "dev": st.st_dev, "ino": st.st_ino}  # fmt: skip
    link_remap.unpark([record])  # nothing to link: it is there
    link_remap.drop_unparked([record])  # a failed restore keeps the image's only link
    assert path.read_text() == "sem"
    os.link(path, shm / "held")  # (the file lives on: a new one gets another inode)
    link_remap.discard([record])  # the image goes: so does its link
    assert not path.exists()
    path.write_text("someone else's")
    with pytest.raises(CheckpointFailed, match="not the file the dump left there"):
        link_remap.unpark([record])
    link_remap.discard([record])
    assert path.read_text() == "someone else's"


def test_a_dead_tree_s_semaphore_names_go_with_its_image(shm: Path, tmp_path: Path) -> None:
    (shm / "sem.mp-a").write_text("a")  # the tree's semaphore, by its creator's name
    os.link(shm / "sem.mp-a", shm / ".spswap-remap-k-1")  # the image's parked link
    os.link(shm / "sem.mp-a", shm / "not-a-semaphore-name")
    (shm / "sem.mp-b").write_text("b")  # somebody else's
    st = os.stat(shm / "sem.mp-a")
    record = {"dir": str(shm), "name": "link_remap.1", "parked": ".spswap-remap-k-1",
              "dev": st.st_dev, "ino": st.st_ino}  # fmt: skip
    assert link_remap.drop_semaphore_names([record]) == [str(shm / "sem.mp-a")]
    assert sorted(p.name for p in shm.iterdir()) == [
        ".spswap-remap-k-1", "not-a-semaphore-name", "sem.mp-b"]  # fmt: skip
    # the image's own link gone (its inode may be freed, its number reused): nothing
    os.link(shm / "not-a-semaphore-name", shm / "sem.mp-a")
    (shm / ".spswap-remap-k-1").unlink()
    assert link_remap.drop_semaphore_names([record]) == [] and (shm / "sem.mp-a").exists()
    # where a user may rename entries, nothing is unlinked by root
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    (open_dir / "sem.mp-c").write_text("c")
    os.link(open_dir / "sem.mp-c", open_dir / "link_remap.3")
    st = os.stat(open_dir / "sem.mp-c")
    mine = {"dir": str(open_dir), "name": "link_remap.3", "parked": None, "dev": st.st_dev,
            "ino": st.st_ino}  # fmt: skip
    assert link_remap.drop_semaphore_names([mine]) == [] and (open_dir / "sem.mp-c").exists()
