"""Deleting an image after its restore: gone from its name and its outside links at once,
its pages freed after the caller goes on (the run's restore no longer waits for it)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from spswap.checkpoint import criu, link_remap
from spswap.checkpoint.service import images_of_job, removing_dirs, temp_dirs
from spswap.fsutil import atomic_write_json

KEY = "job7-qwen-abc-def"


def _image(root: Path, shm: Path) -> tuple[Path, Path]:
    """An image dir of job 7 with pages and one parked link outside it."""
    image = root / KEY
    image.mkdir(parents=True)
    (image / "pages-1.img").write_bytes(os.urandom(1 << 20))
    parked = shm / f"{link_remap.PARKED_PREFIX}{KEY}-1"
    parked.write_text("sem")
    record = {"dir": str(shm), "name": "link_remap.1", "parked": parked.name}
    atomic_write_json(image / criu.DUMP_META, {"link_remaps": [record]})
    return image, parked


@pytest.fixture
def later(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The directories handed to the freeing thread, held back (not freed) until a test
    frees them itself: what the caller sees before the thread is done."""
    held: list[Path] = []
    monkeypatch.setattr(criu, "free_soon", held.append)
    return held


def test_the_image_leaves_its_name_and_links_at_once(tmp_path: Path, later: list[Path]) -> None:
    root, shm = tmp_path / "images", tmp_path / "shm"
    shm.mkdir()
    image, parked = _image(root, shm)
    assert criu.remove_image_soon(image) == KEY
    assert not image.exists() and images_of_job(root, "7") == []
    assert not parked.exists()  # the job's next image takes the same link names
    (gone,) = later
    assert removing_dirs(root) == [gone] and temp_dirs(root, "7") == []  # no unfinished dump
    assert gone.name.startswith(f".gone-{KEY}-") and (gone / "pages-1.img").exists()
    assert not (gone / criu.DUMP_META).exists()  # no sweep discards the links again


def test_a_later_image_s_links_survive_the_sweep_of_the_one_being_removed(
        tmp_path: Path, later: list[Path]) -> None:  # fmt: skip
    root, shm = tmp_path / "images", tmp_path / "shm"
    shm.mkdir()
    image, parked = _image(root, shm)
    criu.remove_image_soon(image)
    parked.write_text("the next image's")  # the job's next dump parks a link of that name
    (gone,) = later
    criu.remove_image(gone)  # a sweep of the old one (spswapd's start) after that dump
    assert parked.read_text() == "the next image's" and not gone.exists()


def test_the_thread_frees_it(tmp_path: Path) -> None:
    root, shm = tmp_path / "images", tmp_path / "shm"
    shm.mkdir()
    criu.remove_image_soon(_image(root, shm)[0])
    deadline = time.monotonic() + 10
    while list(root.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(root.iterdir()) == []


def test_without_a_thread_the_caller_frees_it(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    (tmp_path / "d" / "e").mkdir(parents=True)
    criu.free_soon(tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_an_image_already_gone_is_no_error(tmp_path: Path) -> None:
    assert criu.remove_image_soon(tmp_path / KEY) == KEY
