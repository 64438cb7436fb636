#!/usr/bin/env python3
"""Why is pool -> GPU slower for vLLM-shaped weights than for 64 MiB tensors? A probe:
the same entry copied by spswap's copy_into, by raw cudaMemcpyAsync calls, and as one
buffer. Run on the GPU machine: PYTHONPATH=$PWD python3 scripts/gpu/copy_probe.py"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from spswap.pool.manifest import padded_size_bytes
from spswap.pool.store import Pool
from spswap.transfer.copy import copy_into
from spswap.transfer.mapping import MappedEntry


def qwen2_shapes(hidden=896, inter=4864, layers=24, heads=14, kv=2, vocab=151936):
    head = hidden // heads
    qkv = hidden + 2 * kv * head
    shapes = [("embed", (vocab, hidden))]
    for i in range(layers):
        shapes += [
            (f"l{i}.qkv", (qkv, hidden)),
            (f"l{i}.qkv_b", (qkv,)),
            (f"l{i}.o", (hidden, hidden)),
            (f"l{i}.gate_up", (2 * inter, hidden)),
            (f"l{i}.down", (hidden, inter)),
            (f"l{i}.ln1", (hidden,)),
            (f"l{i}.ln2", (hidden,)),
        ]
    return shapes + [("norm", (hidden,))]


def main() -> None:
    out = {}
    work = Path(tempfile.mkdtemp(dir="/dev/shm"))
    pool = Pool(work / "pool")
    shapes = qwen2_shapes()
    sizes = [2 * int(torch.tensor(s).prod()) for _, s in shapes]
    with pool.writer("probe", expected_size_bytes=padded_size_bytes(sizes)) as w:
        for (name, shape), n in zip(shapes, sizes, strict=False):
            w.add(name, "BF16", shape, bytes(n))
    m = w.manifest
    mapping = MappedEntry(m, pool.data_path(m))
    params = {n: torch.empty(s, dtype=torch.bfloat16, device="cuda") for n, s in shapes}
    total = sum(sizes)
    out["tensors"] = len(shapes)
    out["bytes"] = total
    out["register_s"] = mapping.register_cuda()
    srcs = mapping.tensors()
    out["src_is_pinned"] = [bool(t.is_pinned()) for t in list(srcs.values())[:3]]
    best = 1e9
    for _ in range(5):
        r = copy_into(mapping, params)
        best = min(best, r.seconds)
    out["copy_into_gb_s"] = total / best / 1e9
    from cuda.bindings import runtime as rt

    stream = torch.cuda.Stream()
    kind = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
    best = 1e9
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for name, src in srcs.items():
            d = params[name]
            rt.cudaMemcpyAsync(
                d.data_ptr(), src.data_ptr(), d.numel() * 2, kind, stream.cuda_stream
            )
        stream.synchronize()
        best = min(best, time.perf_counter() - t0)
    out["raw_memcpy_async_gb_s"] = total / best / 1e9
    best = 1e9
    with torch.cuda.stream(stream):
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for name, src in srcs.items():
                params[name].copy_(src, non_blocking=True)
            stream.synchronize()
            best = min(best, time.perf_counter() - t0)
    out["torch_copy_loop_gb_s"] = total / best / 1e9
    flat = torch.empty(m.data_size_bytes, dtype=torch.uint8, device="cuda")
    whole = mapping._base  # the whole read-only mapping as one uint8 tensor
    if whole is not None:
        best = 1e9
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            flat.copy_(whole, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        out["one_buffer_gb_s"] = m.data_size_bytes / best / 1e9
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
