#!/usr/bin/env python3
"""How fast can a restore fill fresh anonymous memory from a tmpfs file? CRIU's restore
of a vLLM image is its page reads (docs/benchmarks.md, table 3: 1.6 GB/s on the H200's
machine, the engine core's 2.2 GB read by one ``preadv`` loop). This probe reads a file
on /dev/shm into new private anonymous memory, as CRIU's restorer does, three ways:

- ``small``: plain 4 KiB faults (what CRIU does today),
- ``huge``: the region ``madvise(MADV_HUGEPAGE)`` first (transparent huge pages, where
  the kernel's THP mode allows it),
- ``populate``: the region pre-faulted with ``MADV_POPULATE_WRITE`` (Linux 5.14+), then read.

    python3 scripts/gpu/page_fill_probe.py [--size-mib 2048] [--repeats 3]

Prints the machine's THP settings and one JSON line per read (seconds, GB/s). Needs only
Python; it changes no setting.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time
from pathlib import Path

MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module names it only from 3.13 on


def thp_settings() -> dict[str, str]:
    base = Path("/sys/kernel/mm/transparent_hugepage")
    out = {}
    for name in ("enabled", "defrag", "shmem_enabled"):
        try:
            out[name] = (base / name).read_text().strip()
        except OSError as e:
            out[name] = f"unreadable: {e.strerror}"
    return out


def fill(fd: int, size_bytes: int, mode: str) -> dict[str, object]:
    region = mmap.mmap(-1, size_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        t0 = time.monotonic()
        if mode == "huge":
            region.madvise(mmap.MADV_HUGEPAGE)
        elif mode == "populate":
            region.madvise(MADV_POPULATE_WRITE)
        t1 = time.monotonic()
        view = memoryview(region)
        done = 0
        while done < size_bytes:  # preadv may return short reads on large sizes
            done += os.preadv(fd, [view[done:]], done)
        t2 = time.monotonic()
        view.release()
        return {"mode": mode, "prepare_s": round(t1 - t0, 4), "read_s": round(t2 - t1, 4),
                "gb_per_s": round(size_bytes / (t2 - t0) / 1e9, 2)}  # fmt: skip
    finally:
        region.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm")
    args = ap.parse_args()
    size_bytes = args.size_mib << 20
    print(json.dumps({"thp": thp_settings(), "size_bytes": size_bytes}))
    src = Path(args.dir) / f"page-fill-probe-{os.getpid()}"
    try:
        with open(src, "wb") as f:
            block = os.urandom(1 << 20)
            for _ in range(args.size_mib):
                f.write(block)
        fd = os.open(src, os.O_RDONLY)
        try:
            for _ in range(args.repeats):
                for mode in ("small", "huge", "populate"):
                    print(json.dumps(fill(fd, size_bytes, mode)), flush=True)
        finally:
            os.close(fd)
    finally:
        src.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
