"""``spswap bench transfer``: pool -> device copy throughput against the device's limit.

For each size, in the same run: a pool entry of that size (64 MiB tensors) copied into
device tensors through :mod:`spswap.transfer` (registered mapping, one stream, one
sync); a plain pinned buffer (``cudaHostAlloc``) copied in one piece, which is what the
link can do; and a pageable buffer, which is what an unregistered copy gets. Each method
is warmed up once, then timed ``repeats`` times; best and median are kept. On a CPU
device all three are memcpy, and pinned is not measured.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.table import Table

from spswap.pool.store import Pool
from spswap.transfer.copy import copy_into
from spswap.transfer.mapping import MappedEntry
from spswap.units import fmt_bytes, fmt_seconds

TENSOR_BYTES = 64 << 20
SEED = 0


def _stats(seconds: list[float], size_bytes: int) -> dict[str, Any]:
    rates = [size_bytes / s / 1e9 for s in seconds]
    return {"seconds": seconds, "best_gb_per_s": max(rates),
            "median_gb_per_s": statistics.median(rates)}  # fmt: skip


def _timed(fn: Callable[[], float], repeats: int) -> list[float]:
    fn()  # warm-up: first-touch, lazy CUDA init, allocator growth
    return [fn() for _ in range(repeats)]


def _write_entry(pool: Pool, size_bytes: int) -> Any:
    rng = np.random.default_rng(SEED)
    chunk = rng.integers(0, 256, size=min(size_bytes, TENSOR_BYTES), dtype=np.uint8)
    n_full, rest = divmod(size_bytes, TENSOR_BYTES)
    sizes = [TENSOR_BYTES] * n_full + ([rest] if rest else [])
    with pool.writer(f"bench-{size_bytes}", expected_size_bytes=size_bytes) as w:
        for i, n in enumerate(sizes):
            w.add(f"t{i:05d}", "U8", (n,), chunk[:n])
    return w.manifest


def _buffer_copy(src: torch.Tensor, dst: torch.Tensor) -> Callable[[], float]:
    def run() -> float:
        if dst.device.type == "cuda":
            stream = torch.cuda.Stream(device=dst.device)
            start = time.perf_counter()
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()
        else:
            start = time.perf_counter()
            dst.copy_(src)
        return time.perf_counter() - start

    return run


def _bench_size(pool: Pool, size_bytes: int, device: torch.device, repeats: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    manifest = _write_entry(pool, size_bytes)
    row: dict[str, Any] = {
        "size_bytes": size_bytes, "tensors": len(manifest.tensors),
        "write_entry_s": time.perf_counter() - t0, "register_s": None,
    }  # fmt: skip
    with MappedEntry(manifest, pool.data_path(manifest)) as mapping:
        if device.type == "cuda":
            row["register_s"] = mapping.register_cuda()
        params = {t.name: torch.empty(t.shape, dtype=torch.uint8, device=device)
                  for t in manifest.tensors}  # fmt: skip
        row["pool"] = _stats(
            _timed(lambda: copy_into(mapping, params).seconds, repeats), size_bytes
        )
        params.clear()
    pool.remove(manifest.digest)

    dst = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    if device.type == "cuda":
        t0 = time.perf_counter()
        pinned = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True)
        row["pinned_alloc_s"] = time.perf_counter() - t0
        pinned.fill_(1)
        row["pinned"] = _stats(_timed(_buffer_copy(pinned, dst), repeats), size_bytes)
        del pinned
    else:
        row["pinned"] = None
    pageable = torch.empty(size_bytes, dtype=torch.uint8)
    pageable.fill_(1)  # fault the pages in: we time the copy, not first touch
    row["pageable"] = _stats(_timed(_buffer_copy(pageable, dst), repeats), size_bytes)
    del pageable, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    row["pool_to_pinned"] = (
        row["pool"]["best_gb_per_s"] / row["pinned"]["best_gb_per_s"] if row["pinned"] else None
    )
    row["pool_to_pageable"] = row["pool"]["best_gb_per_s"] / row["pageable"]["best_gb_per_s"]
    return row


# A size holds two buffers of its size in host memory at once, plus a tenth of margin.
HOST_BYTES_PER_SIZE_BYTE = 2.2


def memory_problem(
    sizes_bytes: list[int], *, available_bytes: int | None, scratch: Path,
    scratch_free_bytes: int | None,
) -> str | None:  # fmt: skip
    """Why the sizes will not fit this machine, in the user's words, or None. Each size
    holds two buffers of its size in host memory at once (its pool entry, in the scratch
    directory, and the copy's destination on a CPU device; then the pinned and pageable
    sources), so the largest needs twice its size available (plus a tenth), and its
    entry must fit the scratch directory. A run past that is killed for memory part-way,
    with no table, and leaves its scratch entry behind."""
    largest = max(sizes_bytes)
    need = {size: int(size * HOST_BYTES_PER_SIZE_BYTE) for size in sizes_bytes}
    if available_bytes is not None and need[largest] > available_bytes:
        fitting = [size for size in sizes_bytes if need[size] <= available_bytes]
        hint = ",".join(fmt_size_arg(size) for size in fitting) or "64M"
        return (f"--sizes asks for {fmt_bytes(largest)}: a size needs about twice that in "
                f"memory at once ({fmt_bytes(need[largest])} with a margin), and this "
                f"machine has {fmt_bytes(available_bytes)} available; give smaller --sizes, "
                f"e.g. --sizes {hint}")  # fmt: skip
    if scratch_free_bytes is not None and largest > scratch_free_bytes:
        return (f"--sizes asks for {fmt_bytes(largest)} but the scratch directory {scratch} "
                f"has {fmt_bytes(scratch_free_bytes)} free; give --scratch-dir DIR on a tmpfs "
                "with room, or smaller --sizes")  # fmt: skip
    return None


def fmt_size_arg(size_bytes: int) -> str:
    """A size as ``--sizes`` takes it back: ``64M``, ``1G``, else plain bytes."""
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size_bytes % unit == 0:
            return f"{size_bytes // unit}{suffix}"
    return str(size_bytes)


def bench_transfer(
    sizes_bytes: list[int], *, device: str, repeats: int, root: Path,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Measure every size on ``device``; the pool lives under ``root`` (use tmpfs: the pool's
    real home) and each size's entry is removed once measured. Returns plain JSON data."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.init()
        dev = torch.device("cuda", dev.index if dev.index is not None else 0)
    pool = Pool(Path(root) / "pool")
    rows = []
    for size in sizes_bytes:
        if progress:
            progress(f"{fmt_bytes(size)} on {dev}")
        rows.append(_bench_size(pool, size, dev, repeats))
    return {
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "repeats": repeats,
        "tensor_bytes": TENSOR_BYTES,
        "rows": rows,
    }


def _rate(stats: dict[str, Any] | None) -> str:
    if stats is None:
        return "n/a"
    return f"{stats['best_gb_per_s']:.2f} ({stats['median_gb_per_s']:.2f})"


def _caption(result: dict[str, Any]) -> str:
    if not result["device"].startswith("cuda"):
        ratios = [r["pool_to_pageable"] for r in result["rows"]]
        return ("a CPU device: every copy is a memcpy; registration and the pinned limit need "
                "a CUDA device (n/a); pool / pageable: "
                + ", ".join(f"{x:.0%}" for x in ratios))  # fmt: skip
    return "pinned = one cudaHostAlloc buffer copied in one piece: the link's limit"


def render_bench_transfer(result: dict[str, Any]) -> Table:
    """The result as a table: GB/s best (median) per method, and the pool's ratio."""
    table = Table(
        title=f"pool -> {result['device']} ({result['device_name']}), torch {result['torch']}, "
        f"best of {result['repeats']} (median)",
        caption=_caption(result),
    )
    for col in ("size", "tensors", "register", "pool GB/s", "pinned GB/s", "pageable GB/s",
                "pool / pinned"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in result["rows"]:
        ratio = r["pool_to_pinned"]
        ratio_txt = "n/a" if ratio is None else (
            f"[green]{ratio:.1%}[/]" if ratio >= 0.95 else f"[yellow]{ratio:.1%}[/]"
        )  # fmt: skip
        reg = "n/a" if r["register_s"] is None else fmt_seconds(r["register_s"])
        table.add_row(fmt_bytes(r["size_bytes"]), str(r["tensors"]), reg, _rate(r["pool"]),
                      _rate(r["pinned"]), _rate(r["pageable"]), ratio_txt)  # fmt: skip
    return table
