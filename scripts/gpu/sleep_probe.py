#!/usr/bin/env python3
"""Where does an in-process spswap cycle's time go inside vLLM, and how long are host ->
GPU copies slow after the sleep? GPU machine, vLLM kit on PYTHONPATH:

    python3 scripts/gpu/sleep_probe.py MODEL_DIR [--kv-gib 0 4] [--cycles 3]

For each KV cache size (0: what ``gpu_memory_utilization=0.4`` leaves, vLLM's sizing;
else ``kv_cache_memory_bytes``): start the engine from the pool (exported on first use),
time vLLM's sleep-mode allocator inside the worker (each unmap/release and create/map by
tag, the ``gc.collect()`` and ``empty_cache()`` of its sleep), run ``--cycles`` spswap
cycles, then one cycle with a timeline of 64 MiB pinned -> GPU copies (copy engines)
between the weights wake and the copy. Prints ``CYCLE`` and ``TIMELINE`` JSON lines.

``--pack``: first move the weights into one allocation of vLLM's sleep-mode pool
(``VllmEngine.pack``, spswap.engines.vllm_pack), so that a sleep unmaps and a wake maps
one allocation for the weights instead of one per segment (docs/notes/copy-after-sleep.md:
~40-50 us a call). Prints ``PACK`` (allocations by tag before and after) and ``ANSWERS``
(greedy tokens before the pack and after the cycles, compared).

Diagnostics only: it sends functions to the worker, so it sets
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` for its own engine.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

PIECE_BYTES = 64 << 20


def _install(worker: Any) -> dict[str, Any]:
    """In the worker: wrap vLLM's allocator calls with timers (once)."""
    import gc as real_gc
    import time as t

    import torch
    import vllm.device_allocator.cumem as cm

    w = getattr(worker, "worker", worker)
    if getattr(cm, "_probe_rec", None) is not None:
        return {"installed": False}
    rec: list[tuple[str, int, float]] = []
    cm._probe_rec = rec
    alloc = cm.CuMemAllocator.get_instance()
    tags = {int(data.handle[2]): data.tag for data in alloc.pointer_to_data.values()}
    cm._probe_tags = tags

    def timed(kind: str, fn: Any) -> Any:
        def call(handle: Any) -> Any:
            s = t.perf_counter()
            out = fn(handle)
            rec.append((f"{kind}:{tags.get(int(handle[2]), '?')}", int(handle[1]),
                        t.perf_counter() - s))  # fmt: skip
            return out

        return call

    cm.unmap_and_release = timed("unmap", cm.unmap_and_release)
    cm.create_and_map = timed("create", cm.create_and_map)

    class TimedGc:
        @staticmethod
        def collect(*a: Any) -> int:
            s = t.perf_counter()
            n = real_gc.collect(*a)
            rec.append(("gc.collect", n, t.perf_counter() - s))
            return n

    cm.gc = TimedGc
    empty = torch.cuda.empty_cache

    def timed_empty() -> None:
        s = t.perf_counter()
        empty()
        rec.append(("empty_cache", 0, t.perf_counter() - s))

    torch.cuda.empty_cache = timed_empty
    for name in ("sleep", "wake_up"):
        fn = getattr(w, name)

        def wrapped(*a: Any, _fn: Any = fn, _name: str = name, **k: Any) -> Any:
            s = t.perf_counter()
            out = _fn(*a, **k)
            rec.append((f"worker.{_name}", 0, t.perf_counter() - s))
            if _name == "sleep":
                cm._probe_slept_at = t.perf_counter()
            return out

        setattr(w, name, wrapped)
    # Pinned source and device target for the timeline, made before any sleep (they
    # live in torch's own pool, outside vLLM's sleep-mode pool: they survive the sleep).
    cm._probe_src = torch.empty(PIECE_BYTES, dtype=torch.uint8, pin_memory=True).fill_(7)
    cm._probe_dst = torch.empty(PIECE_BYTES, dtype=torch.uint8, device="cuda")
    cm._probe_stream = torch.cuda.Stream()
    return {"installed": True, "allocations": len(tags),
            "by_tag": {tag: sum(1 for v in tags.values() if v == tag)
                       for tag in set(tags.values())}}  # fmt: skip


def _records(worker: Any) -> dict[str, Any]:
    """In the worker: the timers' records since the last call, summed by kind."""
    import vllm.device_allocator.cumem as cm

    rec = cm._probe_rec
    out: dict[str, list[float]] = {}
    for kind, size, sec in rec:
        agg = out.setdefault(kind, [0, 0, 0.0])
        agg[0] += 1
        agg[1] += size if kind.startswith(("unmap", "create")) else 0
        agg[2] += sec
    rec.clear()
    return {k: {"calls": v[0], "bytes": v[1], "seconds": round(v[2], 4)} for k, v in out.items()}


def _timeline(worker: Any, window_s: float) -> dict[str, Any]:
    """In the worker: back-to-back 64 MiB copies for ``window_s``; (s since sleep, GB/s)."""
    import time as t

    import torch
    import vllm.device_allocator.cumem as cm

    src, dst, stream = cm._probe_src, cm._probe_dst, cm._probe_stream
    points = []
    start = t.perf_counter()
    while (now := t.perf_counter()) - start < window_s:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()
        points.append((round(now - cm._probe_slept_at, 4),
                       round(PIECE_BYTES / (t.perf_counter() - now) / 1e9, 1)))  # fmt: skip
    # mean rate per 50 ms after the sleep ended, by bytes over time
    sums: dict[int, list[float]] = {}
    for at, rate in points:
        b = sums.setdefault(int(at / 0.05), [0.0, 0.0])
        b[0] += PIECE_BYTES
        b[1] += PIECE_BYTES / rate / 1e9
    return {"first_piece_at_s": points[0][0] if points else None,
            "gb_s_per_50ms": {f"{k * 0.05:.2f}": round(v[0] / v[1] / 1e9, 1)
                              for k, v in sorted(sums.items())}}  # fmt: skip


PROMPTS = [[1, 2, 3, 4, 5], [100, 200, 300], [7] * 12]


def run_size(model: Path, pool: Any, kv_gib: float, cycles: int, pack: bool = False) -> None:
    from spswap.engines.vllm_engine import VllmEngine, VllmSettings, rank_result

    settings = VllmSettings(kv_cache_memory_bytes=int(kv_gib * (1 << 30)) if kv_gib else None)
    eng = VllmEngine(model, settings)
    try:
        started = eng.start(pool, f"probe-{model.name}")
        llm = eng.llm
        print("START", json.dumps({"kv_gib": kv_gib, "from": started["from"],
                                   "start_s": started["start_s"]}), flush=True)  # fmt: skip

        def rpc(fn: Any, *args: Any) -> dict[str, Any]:
            return rank_result(llm.collective_rpc(fn, args=args), "probe", 1)

        if pack:
            answers = eng.generate(PROMPTS, 8)
            print("PACK", json.dumps(eng.pack()), flush=True)
        print("INSTALL", json.dumps(rpc(_install)), flush=True)
        rpc(_records)
        for i in range(cycles):
            sleep_s = eng.sleep()
            eng.wake()
            w = eng.last_wake
            assert w is not None
            print("CYCLE", json.dumps({
                "kv_gib": kv_gib, "cycle": i, "sleep_s": round(sleep_s, 4),
                "wake_weights_s": round(w.wake_weights_s, 4), "copy_rpc_s": round(w.copy_s, 4),
                "copy_gb_s": round(w.copy["size_bytes"] / w.copy["seconds"] / 1e9, 1),
                "wake_kv_s": round(w.wake_kv_s, 4),
                "total_s": round(sleep_s + w.total_s, 4), "inside": rpc(_records),
            }), flush=True)  # fmt: skip
        if pack:  # (asked while the engine is awake: the timeline below wakes vLLM only)
            after = eng.generate(PROMPTS, 8)
            print("ANSWERS", json.dumps({"identical": after == answers}), flush=True)
        eng.sleep()
        s = time.perf_counter()
        llm.wake_up(tags=["weights"])
        wake_w = time.perf_counter() - s
        line = rpc(_timeline, 1.0)
        copy = rpc("spswap_copy", 0.0)
        llm.wake_up(tags=["kv_cache"])
        print("TIMELINE", json.dumps({
            "kv_gib": kv_gib, "wake_weights_s": round(wake_w, 4),
            "then_staged_copy_gb_s": round(copy["size_bytes"] / copy["seconds"] / 1e9, 1),
            "inside": rpc(_records), **line,
        }), flush=True)  # fmt: skip
        verify = rpc("spswap_verify", str(pool.pool_dir), eng._attached["digest"])
        print("VERIFY", json.dumps({"kv_gib": kv_gib, **verify}), flush=True)
    finally:
        eng.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--kv-gib", type=float, nargs="+", default=[0, 4])
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--pack", action="store_true", help="the weights in one allocation first")
    args = ap.parse_args()
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # functions sent to the worker
    from spswap.pool.store import Pool

    pool = Pool(Path(tempfile.mkdtemp(dir="/dev/shm")) / "pool")
    for kv in args.kv_gib:
        run_size(args.model, pool, kv, args.cycles, args.pack)


if __name__ == "__main__":
    main()
