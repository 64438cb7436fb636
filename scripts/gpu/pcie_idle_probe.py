#!/usr/bin/env python3
"""Is a host -> GPU copy slow because the GPU was idle just before it (PCIe link and
clocks stepped down), rather than because its target memory is new? GPU machine, torch
only (pynvml optional):

    python3 scripts/gpu/pcie_idle_probe.py [--size-mib 2048]

Prints one JSON line per case: the copy rate after an idle pause of several lengths, and
after the same pause followed by a small "wake-up" copy and a ramp delay; with pynvml,
the PCIe link generation before and after each copy.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

import torch


def link_gen() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h))
    except Exception:
        return None


def timed_copy(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    stream.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=2048)
    args = ap.parse_args()
    size = args.size_mib << 20
    src = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    src.fill_(3)
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    small_src, small_dst = src[: 8 << 20], dst[: 8 << 20]
    stream = torch.cuda.Stream()
    timed_copy(dst, src, stream)

    def case(
        name: str, idle_s: float, warm_ramp_s: float | None = None, keepalive: bool = False
    ) -> dict[str, Any]:
        stop = threading.Event()
        if keepalive:  # a 1 MiB copy every 5 ms during the pause

            def tick() -> None:
                s2 = torch.cuda.Stream()
                while not stop.wait(0.005):
                    with torch.cuda.stream(s2):
                        small_dst[: 1 << 20].copy_(small_src[: 1 << 20], non_blocking=True)
                    s2.synchronize()

            th = threading.Thread(target=tick)
            th.start()
        time.sleep(idle_s)
        stop.set()
        if keepalive:
            th.join()
        gen_before = link_gen()
        if warm_ramp_s is not None:
            timed_copy(small_dst, small_src, stream)
            time.sleep(warm_ramp_s)
        seconds = timed_copy(dst, src, stream)
        again = timed_copy(dst, src, stream)
        return {
            "case": name,
            "idle_s": idle_s,
            "warm_ramp_s": warm_ramp_s,
            "keepalive": keepalive,
            "gen_before": gen_before,
            "gen_after": link_gen(),
            "gb_per_s": size / seconds / 1e9,
            "again_gb_per_s": size / again / 1e9,
        }

    cases = [("hot", 0.0), ("idle", 0.05), ("idle", 0.2), ("idle", 1.0), ("idle", 3.0)]
    for name, idle in cases:
        print("IDLE", json.dumps(case(name, idle)), flush=True)
    for ramp in (0.0, 0.01, 0.05, 0.2):
        print("IDLE", json.dumps(case("warm", 3.0, warm_ramp_s=ramp)), flush=True)
    print("IDLE", json.dumps(case("keepalive", 3.0, keepalive=True)), flush=True)
    # New memory, hot link: is it the memory or the pause?
    torch.cuda.synchronize()
    timed_copy(dst, src, stream)
    fresh = torch.empty(size, dtype=torch.uint8, device="cuda")
    seconds = timed_copy(fresh, src, stream)
    print("IDLE", json.dumps({"case": "fresh-memory-hot", "gb_per_s": size / seconds / 1e9}))


if __name__ == "__main__":
    main()
