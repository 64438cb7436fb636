"""spswap.checkpoint.image_layout: an image's dumped bytes by kind of memory, read from
CRIU's own files (written here by hand, and by the real CRIU)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from spswap.checkpoint import criu
from spswap.checkpoint import image_layout as il
from spswap.cli.app import app
from spswap.cli.images import collect_images, find_image, largest_lines, layout_notes, layout_rows
from spswap.errors import ConfigError, ImageNotFound, ImageUnreadable

from . import criu_images as ci
from .criu_helpers import needs_criu

P = il.PAGE_BYTES
HEAP = il.VMA_AREA_HEAP | il.VMA_ANON_PRIVATE | 1
ANON = il.VMA_ANON_PRIVATE | 1
FILE = il.VMA_FILE_PRIVATE | 1
SHM = il.VMA_ANON_SHARED | 1
VDSO = il.VMA_AREA_VDSO | 1


Run = tuple[int, int, int | None, bool]


def _write(d: Path, pid: int, vmas: list[tuple[int, int, int]], runs: list[Run],
           start_stack: int = 0) -> None:  # fmt: skip
    d.mkdir(parents=True, exist_ok=True)
    (d / f"mm-{pid}.img").write_bytes(ci.mm_img(vmas, start_stack))
    (d / f"pagemap-{pid}.img").write_bytes(ci.pagemap_img(runs))


def test_each_kind_of_area_counts_its_dumped_pages(tmp_path: Path) -> None:
    vmas = [(0x10000, 0x20000, HEAP), (0x100000, 0x200000, ANON), (0x300000, 0x302000, FILE),
            (0x400000, 0x404000, SHM), (0x500000, 0x501000, VDSO),
            (0x7000000, 0x7010000, ANON)]  # fmt: skip
    runs = [
        (0x10000, 4, il.PE_PRESENT, False),  # heap: 4 pages
        (0x1FF000, 3, il.PE_PRESENT, False),  # 1 page anon, then 2 pages past it: no area
        (0x300000, 2, il.PE_PRESENT, False),  # file private
        (0x100000, 8, il.PE_PRESENT | il.PE_PARENT, False),  # in a parent image: not here
        (0x100000, 5, None, True),  # an old image's in_parent: not here either
        (0x100000, 6, None, False),  # an old image's run in this one: counted
        (0x500000, 1, il.PE_PRESENT, False),  # vdso
        (0x7008000, 2, il.PE_PRESENT, False),  # the stack (holds mm_start_stack)
    ]
    _write(tmp_path, 7, vmas, runs, start_stack=0x700F000)
    layout = il.image_layout(tmp_path)
    assert [p.pid for p in layout.processes] == [7]
    assert layout.bytes_by_kind() == {"heap": 4 * P, "anonymous": 7 * P, "stack": 2 * P,
                                      "file private": 2 * P, "shared": 0,
                                      "other": 3 * P}  # fmt: skip
    largest = layout.processes[0].largest
    assert [(a.start, a.kind, a.dumped_bytes, a.size_bytes) for a in largest] == [
        (0x100000, "anonymous", 7 * P, 0x100000), (0x10000, "heap", 4 * P, 0x10000)]  # fmt: skip


def test_a_run_across_two_areas_is_split_between_them() -> None:
    vmas = [il.Vma(0x1000, 0x3000, HEAP), il.Vma(0x3000, 0x6000, ANON)]
    layout = il.process_layout(1, vmas, [il.PageRun(0x2000, 3, True)])
    assert layout.bytes_by_kind["heap"] == P and layout.bytes_by_kind["anonymous"] == 2 * P
    assert layout.dumped_bytes == 3 * P


def test_kinds_of_status_bits() -> None:
    memfd_private = il.VMA_AREA_MEMFD | il.VMA_FILE_PRIVATE | 1  # its own copied pages
    kinds = [il.vma_kind(s) for s in (HEAP, ANON, FILE, SHM, VDSO, il.VMA_AREA_MEMFD,
                                      memfd_private, 0)]  # fmt: skip
    assert kinds == ["heap", "anonymous", "file private", "shared", "other", "shared",
                     "file private", "other"]  # fmt: skip


def test_rows_and_lines_as_the_command_shows_them(tmp_path: Path) -> None:
    _write(tmp_path, 5, [(0x10000, 0x110000, HEAP)], [(0x10000, 256, il.PE_PRESENT, False)])
    _write(tmp_path, 6, [(0x2000000, 0x6000000, ANON)], [(0x2000000, 16384, il.PE_PRESENT, False)])
    layout = il.image_layout(tmp_path)
    assert layout_rows(layout) == [
        ("", "pid 6", "pid 5", "image"),  # the process with the most dumped bytes first
        ("heap", "0 B", "1.0 MiB", "1.0 MiB"),
        ("anonymous", "64.0 MiB", "0 B", "64.0 MiB"),
        ("stack", "0 B", "0 B", "0 B"),
        ("file private", "0 B", "0 B", "0 B"),
        ("shared", "0 B", "0 B", "0 B"),
        ("other", "0 B", "0 B", "0 B"),
        ("dumped", "64.0 MiB", "1.0 MiB", "65.0 MiB"),
    ]
    assert largest_lines(layout) == [
        "largest areas:",
        "  pid 5     1.0 MiB  heap       at 0x10000 (area 1.0 MiB)",
        "  pid 6    64.0 MiB  anonymous  at 0x2000000 (area 64.0 MiB)",
    ]


def test_more_processes_share_a_column_and_shared_memory_counts_once(tmp_path: Path) -> None:
    mib = (1 << 20) // P
    for pid, pages in ((3, 3 * mib), (4, 4 * mib), (7, 2 * mib), (8, mib)):
        _write(tmp_path, pid, [(0x100000, 0x100000 + pages * P, ANON)],
               [(0x100000, pages, il.PE_PRESENT, False)])  # fmt: skip
    # shared memory's pages: once for the image, in its own pagemap, none in a process's
    (tmp_path / "pagemap-shmem-77.img").write_bytes(
        ci.pagemap_img([(0, 5 * mib, il.PE_PRESENT, False), (0, mib, il.PE_PARENT, False)])
    )
    layout = il.image_layout(tmp_path)
    rows = layout_rows(layout)
    assert rows[0] == ("", "pid 4", "pid 3", "2 more", "image")
    assert rows[2] == ("anonymous", "4.0 MiB", "3.0 MiB", "3.0 MiB", "10.0 MiB")
    assert rows[5] == ("shared", "0 B", "0 B", "0 B", "5.0 MiB")
    assert rows[-1] == ("dumped", "4.0 MiB", "3.0 MiB", "3.0 MiB", "15.0 MiB")
    assert layout_notes(layout) == [
        "a restore from it fills 15.0 MiB; each process fills its own, side by side: the "
        "largest, pid 4, 4.0 MiB in about 0.0 s at ~2 GB/s",
        "shared memory (5.0 MiB) is dumped once for the image: only the image column counts it",
    ]
    summary = layout.summary_json()  # what a dump's event records: no largest areas
    assert summary["shared_bytes"] == 5 << 20
    assert summary["processes"][0] == {"pid": 3, "dumped_bytes": 3 << 20,
                                       "bytes_by_kind": {**dict.fromkeys(il.KINDS, 0),
                                                         "anonymous": 3 << 20}}  # fmt: skip
    assert "largest" in layout.to_json()["processes"][0]
    assert il.layout_summary_quietly(tmp_path) == summary  # the daemon's event records this
    assert il.layout_summary_quietly(tmp_path / "gone") is None  # restored and deleted


def test_what_is_not_an_image_says_so(tmp_path: Path) -> None:
    with pytest.raises(ImageUnreadable, match="no process images"):
        il.image_layout(tmp_path)
    (tmp_path / "mm-3.img").write_bytes(b"\x19\x43\x56\x54\x00\x00\x00\x00")
    with pytest.raises(ImageUnreadable, match="magic 0x0, expected 0x57492820"):
        il.image_layout(tmp_path)
    (tmp_path / "mm-3.img").write_bytes(ci.mm_img([(0x1000, 0x2000, ANON)]))
    with pytest.raises(ImageUnreadable, match=r"cannot read .*pagemap-3\.img"):
        il.image_layout(tmp_path)
    (tmp_path / "pagemap-3.img").write_bytes(ci.pagemap_img([(0x1000, 1, 4, False)])[:-2])
    with pytest.raises(ImageUnreadable, match="truncated"):
        il.image_layout(tmp_path)


def test_images_show_finds_a_job_s_image_and_prints_json(tmp_path: Path) -> None:
    image = tmp_path / "images" / "job12-abc-def"
    _write(image, 9, [(0x10000, 0x20000, HEAP)], [(0x10000, 2, il.PE_PRESENT, False)])
    assert find_image(tmp_path / "images", "12") == image
    assert find_image(tmp_path / "images", "job12-abc-def") == image
    with pytest.raises(ImageNotFound, match="image of job '1', nor one of that name.*images ls"):
        find_image(tmp_path / "images", "1")
    for bad in ("../images/job12-abc-def", "", ".", ".."):
        with pytest.raises(ConfigError, match="neither a job id nor an image's key"):
            find_image(tmp_path / "images", bad)
    newer = tmp_path / "images" / "job12-abc-xyz"
    _write(newer, 9, [(0x10000, 0x20000, HEAP)], [(0x10000, 1, il.PE_PRESENT, False)])
    os.utime(image, (1, 1))
    assert find_image(tmp_path / "images", "12") == newer  # the newest of the job's
    shutil.rmtree(newer)
    out = CliRunner().invoke(app, ["images", "show", "12", "--json", "--root", str(tmp_path)])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["bytes_by_kind"]["heap"] == 2 * P and report["processes"][0]["pid"] == 9
    assert (report["job_id"], report["key"], report["dumped_bytes"]) == (
        "12", "job12-abc-def", 2 * P)  # fmt: skip
    out = CliRunner().invoke(app, ["images", "show", "12", "--root", str(tmp_path)])
    assert out.exit_code == 0 and "heap" in out.output and "largest areas:" in out.output
    assert "\nkey: job12-abc-def\n" in out.output


# A process with 200 MB freed in its heap's middle (100 kB blocks, every 50th kept), then
# 64 MiB in one mapping; with "trim" it gives its freed heap back before it is dumped.
_HOLEY = """
import sys, time
from spswap.engines.host_heap import release_free_heap
blocks = [bytearray(b"x" * 100_000) for _ in range(2000)]
keep = blocks[::50]
del blocks
big = bytearray(b"y" * (64 << 20))
if sys.argv[1] == "trim":
    release_free_heap()
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.criu
@needs_criu
@pytest.mark.parametrize("mode", ["as-is", "trim"])
def test_a_real_image_shows_the_freed_heap_and_the_release_takes_it_out(
    tmp_path: Path, mode: str
) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _HOLEY, mode], text=True,
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        info = criu.dump(proc.pid, "holey", tmp_path / "images")
    finally:
        proc.kill()
        proc.wait()
    layout = il.image_layout(info.path)
    by_kind = layout.bytes_by_kind()
    pages = sum(p.stat().st_size for p in info.path.glob("pages-*.img"))
    assert sum(by_kind.values()) == pages  # every dumped byte is placed
    assert by_kind["anonymous"] >= 64 << 20  # the 64 MiB mapping
    if mode == "as-is":
        assert by_kind["heap"] > 150_000_000  # the freed blocks are dumped
    else:
        assert by_kind["heap"] < 50_000_000  # given back before the dump


def test_images_show_says_what_to_do_with_an_image_it_cannot_read(tmp_path: Path) -> None:
    image = tmp_path / "images" / "job5-abc"
    image.mkdir(parents=True)
    (image / "mm-3.img").write_bytes(b"not an image")
    out = subprocess.run([sys.executable, "-m", "spswap.cli", "images", "show", "5", "--root",
                          str(tmp_path)], capture_output=True, text=True, timeout=120)  # fmt: skip
    err = " ".join(out.stderr.split())
    assert out.returncode == 1 and "Traceback" not in err, out.stderr
    assert f"error: {image} cannot be read as a CRIU image (magic 0x20746f6e, expected " in err
    assert "it is damaged; a restore refuses it and deletes it, or `spswap images rm 5` now" in err


def test_images_ls_lists_jobs_in_their_order(tmp_path: Path) -> None:
    for job in ("10", "7", "9_2", "11"):
        (tmp_path / f"job{job}-abc").mkdir()
    assert [i["job_id"] for i in collect_images(tmp_path, tmp_path / "none")] == [
        "7", "9_2", "10", "11"]  # fmt: skip
    # a het job's real id (from its status) sorts by its first number too
    from spswap.daemon.statuses import CheckpointState, CheckpointStatuses

    (tmp_path / "job8_1-abc").mkdir()
    CheckpointStatuses(tmp_path / ".st").write("8+1", state=CheckpointState.SAVED)
    assert [i["job_id"] for i in collect_images(tmp_path, tmp_path / ".st")] == [
        "7", "8+1", "9_2", "10", "11"]  # fmt: skip


def test_images_ls_gives_a_het_jobs_real_id(tmp_path: Path) -> None:
    """A het job's image is named with '_' for its '+': ls gives the job's real id (from
    its checkpoint status, which is kept under that id), as `spswap images rm` takes it."""
    from spswap.daemon.statuses import CheckpointState, CheckpointStatuses

    images, statuses = tmp_path / "images", tmp_path / "statuses"
    (images / "job1234_0-abc").mkdir(parents=True)
    CheckpointStatuses(statuses).write("1234+0", state=CheckpointState.SAVED)
    (listed,) = collect_images(images, statuses)
    assert (listed["job_id"], listed["key"]) == ("1234+0", "job1234_0-abc")
    assert listed["path"] == str(images / "job1234_0-abc")
