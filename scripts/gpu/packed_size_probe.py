#!/usr/bin/env python3
"""Why did a 7B's packed copy (one 15 GB block filled by one copy from the pool's
registered mapping) run at 84-85% of the pinned rate, when the 0.5B's and 1.5B's blocks
(1.2, 3.3 GiB) filled at 94-99.6% (docs/benchmarks.md runs p-r, 2026-12-08)? GPU
machine, torch only:

    PYTHONPATH=$PWD python3 scripts/gpu/packed_size_probe.py [--sizes-gib 1.2 3.3 8 14.2]
        [--dir /tmp/spswap-bench-huge/psp] [--chunk-mib 256] [--release-gib 0 4]

For each size: a file of that size on a tmpfs (``--dir``: the pools' huge-page tmpfs
when run_vllm.sh mounts one), mapped and registered as a pool entry's data file is
(``cuda_host.register``, read-only), copied into a device block of the same size that
is handed back to the driver and made again before each copy (as a level-2 sleep and a
wake do), with ``--release-gib`` more device memory handed back just before (a sleep's
KV cache: the driver clears it with the copy engines), three ways: one copy of the whole
block (what ``spswap_copy`` does for packed weights), back-to-back ``--chunk-mib``
pieces, and the whole block again into the same block (no fresh mapping). With
``--expandable`` the blocks are torch's VMM segments (``cuMemCreate`` + ``cuMemMap``, as
vLLM's sleep-mode pool maps its allocations), else ``cudaMalloc``'s. Prints one
``PACKSIZE`` JSON line per size and release: GB/s of each way and of a pinned buffer.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time
from pathlib import Path
from typing import Any

import torch

GIB = 1 << 30
WRITE_PIECE_BYTES = 64 << 20


def timed_s(fn: Any, device: torch.device) -> float:
    """Seconds ``fn`` took, the device synchronized before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def release(device: torch.device, size_bytes: int) -> None:
    """Allocate, touch and hand back ``size_bytes`` of device memory to the driver."""
    if size_bytes <= 0:
        return
    t = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    t.fill_(1)
    del t
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def copy_s(block: torch.Tensor, src: torch.Tensor, chunk_bytes: int) -> float:
    """Seconds to fill ``block`` from ``src``: one copy (``chunk_bytes`` 0), or pieces
    issued back to back on the current stream."""
    nb = block.device.type == "cuda"
    size = block.numel()
    step = chunk_bytes or size

    def run() -> None:
        for start in range(0, size, step):
            end = min(size, start + step)
            block[start:end].copy_(src[start:end], non_blocking=nb)

    return timed_s(run, block.device)


def fresh_block(device: torch.device, size_bytes: int) -> torch.Tensor:
    """A device block mapped anew: whatever the allocator cached goes back first."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return torch.empty(size_bytes, dtype=torch.uint8, device=device)


def probe_size(path: Path, size_bytes: int, device: torch.device, *, chunk_bytes: int,
               release_bytes: int, pinned_gb_s: float) -> dict[str, Any]:  # fmt: skip
    """One ``PACKSIZE`` record for a file of ``size_bytes`` at ``path``."""
    with open(path, "wb") as f:
        piece = b"\x5a" * WRITE_PIECE_BYTES
        left = size_bytes
        while left > 0:
            f.write(piece[: min(left, WRITE_PIECE_BYTES)])
            left -= WRITE_PIECE_BYTES
    fd = os.open(path, os.O_RDONLY)
    mapped = mmap.mmap(fd, size_bytes, prot=mmap.PROT_READ)
    registration = None
    try:
        src = torch.frombuffer(memoryview(mapped), dtype=torch.uint8)  # type: ignore[arg-type]
        if device.type == "cuda":
            from spswap.transfer import cuda_host

            registration = cuda_host.register(src.data_ptr(), size_bytes)
        gb = size_bytes / 1e9
        out: dict[str, Any] = {"size_gib": round(size_bytes / GIB, 2),
                               "release_gib": round(release_bytes / GIB, 2),
                               "pinned_gb_s": round(pinned_gb_s, 1)}  # fmt: skip
        rates: dict[str, list[float]] = {"whole": [], "chunked": [], "same_block": []}
        for _ in range(3):
            for way in ("whole", "chunked"):
                release(device, release_bytes)
                block = fresh_block(device, size_bytes)
                rates[way].append(gb / copy_s(block, src, chunk_bytes if way == "chunked" else 0))
                if way == "whole":
                    rates["same_block"].append(gb / copy_s(block, src, 0))
                if not torch.equal(block[-4096:].cpu(), src[-4096:]):
                    raise SystemExit("the copied bytes differ from the file's")
                block = torch.empty(0, dtype=torch.uint8)  # (its memory can go back)
        for way, got in rates.items():
            out[f"{way}_gb_s"] = [round(r, 1) for r in got]
            out[f"{way}_of_pinned"] = round(max(got) / pinned_gb_s, 3) if pinned_gb_s else None
        return out
    finally:
        if registration is not None:
            from spswap.transfer import cuda_host

            cuda_host.unregister(registration)
        src = torch.empty(0, dtype=torch.uint8)  # (no view of the mapping left)
        mapped.close()
        os.close(fd)
        path.unlink(missing_ok=True)


def pinned_rate(device: torch.device, size_bytes: int = 2 * GIB) -> float:
    """GB/s of a plain pinned-buffer copy (the 100% of the comparison)."""
    host = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    copy_s(dev, host, 0)  # (first touch of both)
    return max(size_bytes / 1e9 / copy_s(dev, host, 0) for _ in range(3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-gib", type=float, nargs="+", default=[1.2, 3.3, 8.0, 14.2])
    ap.add_argument("--release-gib", type=float, nargs="+", default=[0.0, 4.0])
    ap.add_argument("--chunk-mib", type=int, default=256)
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm/spswap-psp"))
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script")
    ap.add_argument("--expandable", action="store_true", help="VMM-mapped blocks, as vLLM's")
    a = ap.parse_args()
    if a.expandable:  # (read at CUDA's first allocation, which comes after this)
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    device = torch.device(a.device)
    a.dir.mkdir(parents=True, exist_ok=True)
    pinned = pinned_rate(device, min(2 * GIB, int(min(a.sizes_gib) * GIB)))
    for size_gib in a.sizes_gib:
        for release_gib in a.release_gib:
            size_bytes = int(size_gib * GIB) // 4096 * 4096
            release_bytes = int(release_gib * GIB)
            found = probe_size(a.dir / "entry.data", size_bytes, device,
                               chunk_bytes=a.chunk_mib << 20, release_bytes=release_bytes,
                               pinned_gb_s=pinned)  # fmt: skip
            record = {"expandable": a.expandable, **found}
            print("PACKSIZE " + json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
