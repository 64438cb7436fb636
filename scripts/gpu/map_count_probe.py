#!/usr/bin/env python3
"""Does mapping and unmapping GPU memory cost by the call or by the byte? vLLM's
sleep-mode allocator maps each of its allocations with its own ``cuMemCreate`` +
``cuMemMap`` + ``cuMemSetAccess`` at a wake and unmaps and releases each at a level-2
sleep (12-47 ms of a sleep, 9-43 ms of a weights wake: docs/notes/copy-after-sleep.md).
If the cost is per call, weights held in one allocation would make both shorter. GPU
machine, torch and cuda-bindings only:

    python3 scripts/gpu/map_count_probe.py [--total-gib 1.25 3.5] [--counts 1 16 150 300]

For each total and count: reserve the address ranges once (as vLLM does), then time
mapping all of them (create, map, set access) and unmapping them (unmap, release), three
rounds. Prints one ``MAPCOUNT`` JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def check(result: Any) -> Any:
    """cuda-bindings return (error, values...): raise on an error, return the values."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err}")
    return rest[0] if len(rest) == 1 else rest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--total-gib", type=float, nargs="+", default=[1.25, 3.5])
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 16, 150, 300])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import torch
    from cuda.bindings import driver as cu

    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    device = torch.cuda.current_device()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    gran = check(
        cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        )
    )
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    for total_gib in args.total_gib:
        for count in args.counts:
            size = int(total_gib * (1 << 30)) // count // int(gran) * int(gran)
            ptrs = [check(cu.cuMemAddressReserve(size, 0, 0, 0)) for _ in range(count)]
            maps_s, unmaps_s = [], []
            for _ in range(args.rounds):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                handles = []
                for ptr in ptrs:
                    handle = check(cu.cuMemCreate(size, prop, 0))
                    check(cu.cuMemMap(ptr, size, 0, handle, 0))
                    check(cu.cuMemSetAccess(ptr, size, [access], 1))
                    handles.append(handle)
                t1 = time.perf_counter()
                for ptr, handle in zip(ptrs, handles, strict=True):
                    check(cu.cuMemUnmap(ptr, size))
                    check(cu.cuMemRelease(handle))
                t2 = time.perf_counter()
                maps_s.append(round(t1 - t0, 5))
                unmaps_s.append(round(t2 - t1, 5))
                time.sleep(0.5)  # let the driver clear what was released
            for ptr in ptrs:
                check(cu.cuMemAddressFree(ptr, size))
            print("MAPCOUNT", json.dumps({"total_gib": total_gib, "count": count,
                                          "size_bytes": size, "mapped_bytes": size * count,
                                          "map_s": maps_s, "unmap_s": unmaps_s}),
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
