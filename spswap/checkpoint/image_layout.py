"""What a CRIU image holds, by kind of memory: where a restore's bytes come from.

A restore from an image spends most of its time filling memory (~2 GB/s a process on
the GPU nodes measured): to make it shorter, first know what the bytes are. This reads
the image's own files, no CRIU and no ``crit`` needed: ``mm-<pid>.img`` (the process's
memory areas and what CRIU made of each: heap, stack, anonymous, a file's private
pages, shared memory) and ``pagemap-<pid>.img`` (which pages were dumped), and adds the
dumped bytes of each area up by kind, per process, with the largest heap and anonymous
areas.

Read with :mod:`criu_image`; only the fields used here are decoded (images/mm.proto,
vma.proto, pagemap.proto of CRIU 4.1); a file that is not such an image raises
ImageUnreadable.
"""

from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spswap.checkpoint.criu_image import entries, fields, read_image_file
from spswap.errors import ImageUnreadable

MM_MAGIC = 0x57492820
PAGEMAP_MAGIC = 0x56084025
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")  # CRIU's pagemap counts base pages, huge pages too

# vma_entry.status bits (criu/include/image.h)
VMA_AREA_STACK = 1 << 1
VMA_AREA_VSYSCALL = 1 << 2
VMA_AREA_VDSO = 1 << 3
VMA_AREA_HEAP = 1 << 5
VMA_FILE_PRIVATE = 1 << 6
VMA_FILE_SHARED = 1 << 7
VMA_ANON_SHARED = 1 << 8
VMA_ANON_PRIVATE = 1 << 9
VMA_AREA_SYSVIPC = 1 << 10
VMA_AREA_VVAR = 1 << 12
VMA_AREA_MEMFD = 1 << 14
# pagemap_entry.flags bits (criu/include/pagemap.h)
PE_PARENT = 1 << 0
PE_PRESENT = 1 << 2

# the kinds, in the order they are shown
KINDS = ("heap", "anonymous", "stack", "file private", "shared", "other")
LARGEST_AREAS = 5


@dataclass(frozen=True)
class Vma:
    """One memory area of a dumped process: [start, end) and CRIU's status bits."""

    start: int
    end: int
    status: int

    @property
    def kind(self) -> str:
        return vma_kind(self.status)


@dataclass(frozen=True)
class PageRun:
    """``nr_pages`` pages from ``vaddr``; ``in_image``: their bytes are in this image
    (not in a parent image, not left out)."""

    vaddr: int
    nr_pages: int
    in_image: bool


@dataclass(frozen=True)
class Area:
    """A memory area and the bytes of it the image holds."""

    start: int
    size_bytes: int
    dumped_bytes: int
    kind: str

    def to_json(self) -> dict[str, Any]:
        return {"start": hex(self.start), "size_bytes": self.size_bytes,
                "dumped_bytes": self.dumped_bytes, "kind": self.kind}  # fmt: skip


@dataclass(frozen=True)
class ProcessLayout:
    """One process of the image: its dumped bytes by kind, its largest heap and anonymous
    areas."""

    pid: int
    bytes_by_kind: dict[str, int]
    largest: list[Area]

    @property
    def dumped_bytes(self) -> int:
        return sum(self.bytes_by_kind.values())

    def to_json(self, *, largest: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"pid": self.pid, "dumped_bytes": self.dumped_bytes,
                               "bytes_by_kind": self.bytes_by_kind}  # fmt: skip
        if largest:
            out["largest"] = [a.to_json() for a in self.largest]
        return out


@dataclass(frozen=True)
class ImageLayout:
    """Every process of an image, by pid, and the image's shared memory: CRIU dumps the
    pages of shared memory (anonymous shared, memfd, SysV) once for the image, in
    ``pagemap-shmem-<id>.img``, not in any process's pagemap."""

    processes: list[ProcessLayout]
    shared_bytes: int = 0

    def bytes_by_kind(self) -> dict[str, int]:
        """The whole image's dumped bytes by kind (every kind named, zeros too)."""
        out = dict.fromkeys(KINDS, 0)
        for p in self.processes:
            for k, n in p.bytes_by_kind.items():
                out[k] += n
        out["shared"] += self.shared_bytes
        return out

    @property
    def dumped_bytes(self) -> int:
        """Every byte the image holds of its processes' memory: what a restore fills."""
        return sum(self.bytes_by_kind().values())

    def to_json(self, *, largest: bool = True) -> dict[str, Any]:
        return {"bytes_by_kind": self.bytes_by_kind(), "shared_bytes": self.shared_bytes,
                "processes": [p.to_json(largest=largest) for p in self.processes]}  # fmt: skip

    def summary_json(self) -> dict[str, Any]:
        """:meth:`to_json` without each process's largest areas: what an event holds (an
        event is at most 4 KiB, and a vLLM tree has four processes or more)."""
        return self.to_json(largest=False)


def vma_kind(status: int) -> str:
    """The kind a memory area's dumped bytes count as (see KINDS). A private mapping of a
    file (a memfd's too) counts as "file private": its dumped pages are its own copies."""
    if status & VMA_AREA_HEAP:
        return "heap"
    if status & VMA_AREA_STACK:
        return "stack"
    if status & (VMA_AREA_VDSO | VMA_AREA_VVAR | VMA_AREA_VSYSCALL):
        return "other"
    if status & VMA_FILE_PRIVATE:
        return "file private"
    if status & (VMA_ANON_SHARED | VMA_FILE_SHARED | VMA_AREA_SYSVIPC | VMA_AREA_MEMFD):
        return "shared"
    if status & VMA_ANON_PRIVATE:
        return "anonymous"
    return "other"


def parse_mm(data: bytes) -> list[Vma]:
    """The memory areas of an ``mm-<pid>.img``, in address order. CRIU marks no area of
    the main thread's stack as one: the area holding ``mm_start_stack`` is marked here."""
    msgs = entries(data, MM_MAGIC)
    if not msgs:
        raise ImageUnreadable("an mm image without its entry")
    vmas, start_stack = [], -1
    for number, _, value in fields(msgs[0]):
        if number == 5 and isinstance(value, int):  # mm_entry.mm_start_stack
            start_stack = value
        elif number == 14 and isinstance(value, bytes):  # mm_entry.vmas
            f = {n: v for n, _, v in fields(value) if isinstance(v, int)}
            vmas.append(Vma(start=f.get(1, 0), end=f.get(2, 0), status=f.get(7, 0)))
    vmas = [Vma(v.start, v.end, v.status | VMA_AREA_STACK) if v.start <= start_stack < v.end
            else v for v in vmas]  # fmt: skip
    return sorted(vmas, key=lambda v: v.start)


def parse_pagemap(data: bytes) -> list[PageRun]:
    """The page runs of a ``pagemap-<pid>.img`` (its first entry, the head, skipped)."""
    runs = []
    for msg in entries(data, PAGEMAP_MAGIC)[1:]:
        f = {n: v for n, _, v in fields(msg) if isinstance(v, int)}
        if 4 in f:  # flags, in images of CRIU >= 3.x
            in_image = bool(f[4] & PE_PRESENT) and not f[4] & PE_PARENT
        else:
            in_image = not f.get(3, 0)  # in_parent
        runs.append(PageRun(vaddr=f.get(1, 0), nr_pages=f.get(2, 0), in_image=in_image))
    return runs


def process_layout(pid: int, vmas: list[Vma], runs: list[PageRun]) -> ProcessLayout:
    """Add up the dumped bytes of each area (a page run may span several areas)."""
    starts = [v.start for v in vmas]
    dumped = [0] * len(vmas)
    unplaced = 0
    for run in runs:
        if not run.in_image:
            continue
        addr, end = run.vaddr, run.vaddr + run.nr_pages * PAGE_BYTES
        while addr < end:
            i = bisect.bisect_right(starts, addr) - 1
            if i < 0 or addr >= vmas[i].end:  # not in any area: count it, as "other"
                nxt = starts[i + 1] if i + 1 < len(starts) else end
                step = min(end, nxt) - addr
                unplaced += step
                addr += step
                continue
            step = min(end, vmas[i].end) - addr
            dumped[i] += step
            addr += step
    by_kind = dict.fromkeys(KINDS, 0)
    for v, n in zip(vmas, dumped, strict=True):
        by_kind[v.kind] += n
    by_kind["other"] += unplaced
    anon = [Area(v.start, v.end - v.start, n, v.kind)
            for v, n in zip(vmas, dumped, strict=True)
            if n and v.kind in ("anonymous", "heap")]  # fmt: skip
    anon.sort(key=lambda a: a.dumped_bytes, reverse=True)
    return ProcessLayout(pid, by_kind, anon[:LARGEST_AREAS])


def _in_image_bytes(runs: list[PageRun]) -> int:
    return sum(r.nr_pages for r in runs if r.in_image) * PAGE_BYTES


def image_layout(image_dir: Path) -> ImageLayout:
    """The layout of every process dumped in ``image_dir`` (its ``mm-<pid>.img`` files)
    and its shared memory; ImageUnreadable where a file is missing or not a CRIU image."""
    processes = []
    for mm in sorted(image_dir.glob("mm-*.img")):
        m = re.fullmatch(r"mm-(\d+)\.img", mm.name)
        if m is None:
            continue
        pid = int(m.group(1))
        vmas = parse_mm(read_image_file(mm))
        runs = parse_pagemap(read_image_file(image_dir / f"pagemap-{pid}.img"))
        processes.append(process_layout(pid, vmas, runs))
    if not processes:
        raise ImageUnreadable(f"no process images (mm-<pid>.img) in {image_dir}")
    shared = sum(_in_image_bytes(parse_pagemap(read_image_file(p)))
                 for p in sorted(image_dir.glob("pagemap-shmem-*.img")))  # fmt: skip
    return ImageLayout(processes, shared)


def layout_summary_quietly(image_dir: Path) -> dict[str, Any] | None:
    """:meth:`ImageLayout.summary_json` of the image in ``image_dir``, or None where its
    files cannot be read so (gone meanwhile, or damaged: a restore's checks judge that;
    a report's detail never fails anything)."""
    try:
        return image_layout(image_dir).summary_json()
    except Exception:  # noqa: BLE001 - see the docstring
        return None
