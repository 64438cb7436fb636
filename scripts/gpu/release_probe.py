#!/usr/bin/env python3
"""Does handing device memory back to the driver slow the host -> GPU copies that follow,
for how long, and does that scale with the bytes handed back? GPU machine, torch only:

    python3 scripts/gpu/release_probe.py [--sizes-gib 0 4 16 54] [--window-s 1.2]

For each size: allocate that much device memory, write it, free it and return it to the
driver (``torch.cuda.empty_cache()``; with ``--expandable`` torch's VMM segments are
unmapped and released with ``cuMemRelease``, as vLLM's sleep does), then copy 64 MiB
pieces from a pinned buffer to the device back to back for ``--window-s`` seconds. Prints
one ``RELEASE`` JSON line per size: the rate in each 100 ms bucket after the release, and
how long until a piece ran at 90% of the rate before it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

PIECE_BYTES = 64 << 20
BUCKET_S = 0.1


def timeline(dst: Any, src: Any, stream: Any, window_s: float) -> list[tuple[float, float]]:
    """(seconds since the start, GB/s) of each piece copied during ``window_s``."""
    import torch

    out = []
    start = time.perf_counter()
    while (now := time.perf_counter()) - start < window_s:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()
        end = time.perf_counter()
        out.append((now - start, PIECE_BYTES / (end - now) / 1e9))
    return out


def buckets(points: list[tuple[float, float]]) -> list[float]:
    """Mean rate per :data:`BUCKET_S` bucket, by bytes moved over time spent."""
    n = int(max(t for t, _ in points) / BUCKET_S) + 1
    sums: list[list[float]] = [[0.0, 0.0] for _ in range(n)]
    for t, rate in points:
        b = sums[int(t / BUCKET_S)]
        b[0] += PIECE_BYTES
        b[1] += PIECE_BYTES / rate / 1e9
    return [round(bytes_ / s / 1e9, 1) if s else 0.0 for bytes_, s in sums]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-gib", type=float, nargs="+", default=[0, 4, 16, 54])
    ap.add_argument("--window-s", type=float, default=1.2)
    ap.add_argument("--expandable", action="store_true")
    args = ap.parse_args()
    if args.expandable:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    src = torch.empty(PIECE_BYTES, dtype=torch.uint8, pin_memory=True)
    src.fill_(5)
    dst = torch.empty(PIECE_BYTES, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    timeline(dst, src, stream, 0.3)  # warm up
    for size_gib in args.sizes_gib:
        before = timeline(dst, src, stream, 0.3)
        steady = sorted(r for _, r in before)[len(before) // 2]
        size = int(size_gib * (1 << 30))
        release_s = 0.0
        if size:
            big = torch.empty(size, dtype=torch.uint8, device="cuda")
            big.fill_(1)  # resident, written: what a KV cache or weights would be
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            del big
            torch.cuda.empty_cache()  # back to the driver
            torch.cuda.synchronize()
            release_s = time.perf_counter() - t0
        after = timeline(dst, src, stream, args.window_s)
        slow = [t for t, r in after if r < 0.9 * steady]
        print("RELEASE", json.dumps({
            "size_gib": size_gib, "expandable": args.expandable,
            "release_s": round(release_s, 4), "steady_gb_s": round(steady, 1),
            "bucket_gb_s": buckets(after), "slow_until_s": round(max(slow), 3) if slow else 0.0,
            "slow_pieces": len(slow), "pieces": len(after),
        }), flush=True)  # fmt: skip
        time.sleep(1.5)  # let whatever the driver does finish before the next size


if __name__ == "__main__":
    main()
