"""Deleting an image after its restore: gone from its name and its outside links at once,
its pages freed after the caller goes on (the run's restore no longer waits for it)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from spswap.checkpoint import criu, link_remap
from spswap.checkpoint.service import images_of_job, temp_dirs
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


def test_the_image_leaves_its_name_and_links_at_once_and_its_pages_after(
        tmp_path: Path) -> None:  # fmt: skip
    root, shm = tmp_path / "images", tmp_path / "shm"
    shm.mkdir()
    image, parked = _image(root, shm)
    assert criu.remove_image_soon(image) == KEY
    assert not image.exists() and images_of_job(root, "7") == []
    assert not parked.exists()  # the job's next image takes the same link names
    left = temp_dirs(root, "7")  # an unfinished dump's name: the next dump sweeps it
    for d in left:
        assert d.name.startswith(f".tmp-{KEY}-gone-")
        assert not (d / criu.DUMP_META).exists()  # no sweep discards the links again
    deadline = time.monotonic() + 10
    while temp_dirs(root, "7") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert temp_dirs(root, "7") == [] and list(root.iterdir()) == []


def test_a_later_image_s_links_survive_the_sweep_of_the_one_being_removed(
        tmp_path: Path) -> None:  # fmt: skip
    root, shm = tmp_path / "images", tmp_path / "shm"
    shm.mkdir()
    image, parked = _image(root, shm)
    criu.remove_image_soon(image)
    parked.write_text("the next image's")  # the job's next dump parks a link of that name
    for d in temp_dirs(root, "7"):  # swept (say, by that dump) before the thread ends
        criu.remove_image(d)
    assert parked.read_text() == "the next image's"


def test_an_image_already_gone_is_no_error(tmp_path: Path) -> None:
    assert criu.remove_image_soon(tmp_path / KEY) == KEY
