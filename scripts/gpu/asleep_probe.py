#!/usr/bin/env python3
"""What does a sleeping vLLM leave on the GPU, and what does each trim save from the CUDA
checkpoint? GPU machine, root, vLLM kit on PYTHONPATH:

    python3 scripts/gpu/asleep_probe.py MODEL_DIR [--eager] [--kv-gib 4]

Starts the engine (from the pool, exported on first use), answers once, then measures
the device memory (NVML, the whole device: nothing else may run on it; torch's caching
allocator by memory pool: the default pool and CUDA graphs' private pools) at each step:
up, after ``sleep(level=2)``, after spswap's trim (``spswap_trim``), and after each extra
trim tried here (cuBLAS's workspaces, eager only; the context's per-thread stack set
back to 1 KiB where a kernel grew it, then to each ``--stack-bytes``), with the context's
limits and a bare context's size beside them. Then it CUDA-checkpoints and restores the engine's
process tree (timed), with ``--stack-back`` sets the stack back to its size before those
trims, wakes it and checks the answer is the same (a failure there is reported in the
``CKPT`` line, ``after_error``). Prints ``MEM`` and ``CKPT`` JSON lines, and ``SMAPS``
lines: the engine's host memory by kind of mapping (:func:`smaps_summary`) asleep and
trimmed, then once CUDA-checkpointed (where the GPU state went): what its image's
anonymous memory and heap are made of.

Diagnostics only: it sends functions to the worker, so it sets
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` for its own engine.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20


def _torch_pools(worker: Any) -> dict[str, Any]:
    """In the worker: torch's reserved and allocated bytes by memory pool."""
    import torch

    pools: dict[str, dict[str, int]] = {}
    for seg in torch.cuda.memory_snapshot():
        key = "default" if tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0) else "private"
        p = pools.setdefault(key, {"segments": 0, "reserved": 0, "allocated": 0})
        p["segments"] += 1
        p["reserved"] += int(seg["total_size"])
        p["allocated"] += int(seg["allocated_size"])
    return {k: {kk: (vv // MiB if kk != "segments" else vv) for kk, vv in v.items()}
            for k, v in pools.items()}  # fmt: skip


def _clear_cublas(worker: Any) -> dict[str, Any]:
    """In the worker: drop cuBLAS's workspaces (re-made at the next matmul)."""
    import torch

    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    return {"cleared": True}


_LIMITS = {"stack": 0x00, "printf_fifo": 0x01, "malloc_heap": 0x02}  # CUlimit values


def _ctx_limits(worker: Any, stack_bytes: int | None = None) -> dict[str, Any]:
    """In the worker: the CUDA context's limits (cuCtxGetLimit); with ``stack_bytes``, set
    the per-thread stack to it first (cuCtxSetLimit). A kernel that needed a bigger stack
    grows the context's local memory (stack x resident threads of every SM) and the driver
    keeps it: a candidate for what a sleeping engine holds beyond its pools."""
    import ctypes

    import torch

    torch.cuda.synchronize()  # the primary context current on this thread
    cuda = ctypes.CDLL("libcuda.so.1")
    out: dict[str, Any] = {"module_loading": os.environ.get("CUDA_MODULE_LOADING")}
    if stack_bytes is not None:
        out["set_rc"] = cuda.cuCtxSetLimit(ctypes.c_int(0), ctypes.c_size_t(stack_bytes))
    for name, code in _LIMITS.items():
        value = ctypes.c_size_t(0)
        rc = cuda.cuCtxGetLimit(ctypes.byref(value), ctypes.c_int(code))
        out[name] = int(value.value) if rc == 0 else f"rc {rc}"
    return out


def _bare_context_mib() -> int:
    """A fresh process's CUDA context after one small matmul (torch's floor), by NVML."""
    import subprocess
    import sys

    code = "\n".join([
        "import os, pynvml, torch",
        "a = torch.ones(256, 256, device='cuda')",
        "(a @ a).sum().item()",
        "pynvml.nvmlInit()",
        "h = pynvml.nvmlDeviceGetHandleByIndex(0)",
        "procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)",
        "mine = [p for p in procs if p.pid == os.getpid()]",
        "print(int(mine[0].usedGpuMemory or 0) >> 20 if mine else -1)",
    ])  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return int(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else -1


def _device_used_mib() -> int:
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    return int(pynvml.nvmlDeviceGetMemoryInfo(h).used) // MiB


def _procs_mib() -> dict[int, int]:
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    out = {}
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
        out[int(p.pid)] = int(p.usedGpuMemory or 0) // MiB
    return out


def smaps_summary(text: str) -> dict[str, Any]:
    """A process's resident memory (``/proc/PID/smaps``) by kind of mapping, in MiB: what
    CRIU would dump (private memory) and what it would not (files' clean pages, device
    mappings); the anonymous mappings by size (glibc's thread arenas are 64 MiB, Python's
    own arenas 1 MiB or less) and the largest eight."""
    by_kind: dict[str, float] = {}
    anon_by_size: dict[str, float] = {}
    anon: list[tuple[float, str, str]] = []
    name, size_mib, perms, kind = "", 0.0, "", ""
    for line in text.splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
            start, end = (int(x, 16) for x in head[0].split("-"))
            size_mib, perms = (end - start) / MiB, head[1]
            name, kind = (head[5] if len(head) > 5 else ""), ""
            continue
        if head[:1] == ["Private_Dirty:"] and name.startswith("/") and kind == "file":
            # a file's changed pages: CRIU dumps these (the image's "file private")
            by_kind["file, private dirty"] = by_kind.get("file, private dirty", 0.0) + (
                int(head[1]) / 1024
            )
            continue
        if not head or head[0] != "Rss:":
            continue
        rss_mib = int(head[1]) / 1024
        if name == "":
            kind = "anonymous"
            bucket = ("<= 1 MiB" if size_mib <= 1 else "<= 8 MiB" if size_mib <= 8
                      else "<= 64 MiB" if size_mib <= 64 else "> 64 MiB")  # fmt: skip
            anon_by_size[bucket] = anon_by_size.get(bucket, 0.0) + rss_mib
            anon.append((rss_mib, f"{size_mib:.1f}", perms))
        elif name.startswith("/dev/nvidia"):
            kind = "nvidia device"
        elif name.startswith("["):
            kind = name.split(":")[0].strip("[]")
        elif name.startswith("/memfd:") or name.startswith("/dev/shm"):
            kind = "shared file"
        else:
            kind = "file"
        by_kind[kind] = by_kind.get(kind, 0.0) + rss_mib
    top = sorted(anon, reverse=True)[:8]
    return {"rss_mib_by_kind": {k: round(v, 1) for k, v in sorted(by_kind.items())},
            "anon_rss_mib_by_size": {k: round(v, 1) for k, v in sorted(anon_by_size.items())},
            "largest_anon": [{"rss_mib": round(r, 1), "size_mib": sz, "perms": pm}
                             for r, sz, pm in top]}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--eager", action="store_true", help="eager mode (default: compiled)")
    ap.add_argument("--kv-gib", type=float, default=4.0)
    ap.add_argument("--pool", type=Path, default=Path("/dev/shm/spswap-probe/pool"))
    ap.add_argument("--stack-bytes", type=int, nargs="*", default=[],
                    help="per-thread stack sizes to set in turn before the checkpoint (e.g. "
                    "256 16): does the context's local memory (stack x resident threads, "
                    "~264 MiB at 1 KiB on an H100) shrink, and does the answer after the "
                    "restore stay the same (the driver grows the stack again for a kernel "
                    "that needs it)?")  # fmt: skip
    ap.add_argument("--ckpt-each", action="store_true",
                    help="CUDA-checkpoint and restore after each --stack-bytes (CKPT_AT lines), "
                    "not once at the end: e.g. --stack-bytes 1024 16 --ckpt-each times both "
                    "sizes on one engine")  # fmt: skip
    ap.add_argument("--stack-back", action="store_true",
                    help="after the restore, before the wake, set the stack back to its size "
                    "before --stack-bytes (as spswap's wake does): is a small stack then safe "
                    "for CUDA graphs too? (a compiled engine died at 16 bytes without it, its "
                    "cuBLAS workspaces dropped too, H100 2026-12-06)")  # fmt: skip
    args = ap.parse_args()
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"

    from spswap.checkpoint import cuda_ckpt
    from spswap.engines.vllm_engine import VllmEngine, VllmSettings, kv_cache_bytes
    from spswap.pool.store import Pool

    args.pool.mkdir(parents=True, exist_ok=True)
    pool = Pool(args.pool)
    settings = VllmSettings(
        enforce_eager=args.eager, kv_cache_memory_bytes=kv_cache_bytes(args.kv_gib)
    )
    base = _device_used_mib()
    eng = VllmEngine(args.model, settings)
    t0 = time.perf_counter()
    started = eng.start(pool, f"probe-{args.model.name}")
    mode = "eager" if args.eager else "compiled"
    head = {"model": args.model.name, "mode": mode, "from": started["from"],
            "start_s": round(time.perf_counter() - t0, 2)}  # fmt: skip
    print("START", json.dumps(head), flush=True)
    prompt = [[11, 23, 5, 42, 7, 19, 3, 31]]
    cold = eng.generate(prompt, 16)
    llm = eng.llm

    def mem(step: str) -> None:
        pools = llm.collective_rpc(_torch_pools)[0]
        used_mib = _device_used_mib() - base
        print("MEM", json.dumps({"model": args.model.name, "mode": mode, "step": step,
                                 "device_used_mib": used_mib, "procs_mib": _procs_mib(),
                                 "torch": pools}), flush=True)  # fmt: skip

    mem("up")
    eng.sleep()
    mem("asleep")
    trim = eng.trim()
    mem("trim")
    if args.eager:  # with CUDA graphs a replay after it fails (their kernels use them)
        llm.collective_rpc(_clear_cublas)
        mem("trim+cublas")
    limits = llm.collective_rpc(_ctx_limits)[0]
    print("LIMITS", json.dumps({"model": args.model.name, "mode": mode, "asleep": limits,
                                "bare_context_mib": _bare_context_mib()}), flush=True)  # fmt: skip
    if isinstance(limits.get("stack"), int) and limits["stack"] > 1024:
        after = llm.collective_rpc(_ctx_limits, args=(1024,))[0]
        print("LIMITS", json.dumps({"model": args.model.name, "mode": mode,
                                    "stack_set_1024": after}), flush=True)  # fmt: skip
        mem("trim+cublas+stack")
    stack_before = limits.get("stack")  # the size --stack-back sets again
    root = os.getpid()
    pids = cuda_ckpt.cuda_pids(cuda_ckpt.process_tree_pids(root))
    core = llm.llm_engine.engine_core
    proc = getattr(getattr(core, "resources", None), "engine_manager", None)
    print("TREE", json.dumps({"root": root, "cuda_pids": pids, "core": str(type(proc))}),
          flush=True)  # fmt: skip
    others = [p for p in pids if p != root]

    def smaps(when: str) -> None:
        for p in others:
            try:
                text = Path(f"/proc/{p}/smaps").read_text()
            except OSError as e:
                print("SMAPS", json.dumps({"pid": p, "when": when, "error": str(e)}), flush=True)
                continue
            line = {"model": args.model.name, "mode": mode, "pid": p, "when": when}
            print("SMAPS", json.dumps({**line, **smaps_summary(text)}), flush=True)

    smaps("asleep, trimmed")

    def cycle(ck: dict[str, Any]) -> dict[str, Any]:
        """CUDA checkpoint and restore of the engine's processes, timed into ``ck``."""
        try:
            t = time.perf_counter()
            for p in others:
                cuda_ckpt.lock(p)
            ck["lock_s"] = time.perf_counter() - t
            t = time.perf_counter()
            for p in others:
                cuda_ckpt.checkpoint(p)
            ck["checkpoint_s"] = time.perf_counter() - t
            ck["device_used_ckpt_mib"] = _device_used_mib() - base
            if not ck.get("smaps_taken"):  # where the GPU state went (the image's anonymous)
                smaps("CUDA-checkpointed")
                ck["smaps_taken"] = True
            t = time.perf_counter()
            for p in others:
                cuda_ckpt.restore(p)
            ck["restore_s"] = time.perf_counter() - t
            for p in others:
                cuda_ckpt.unlock(p)
        except Exception as e:  # noqa: BLE001 - a probe reports what failed
            ck["error"] = f"{type(e).__name__}: {e}"
        return ck

    for stack in args.stack_bytes:
        after = llm.collective_rpc(_ctx_limits, args=(stack,))[0]
        print("LIMITS", json.dumps({"model": args.model.name, "mode": mode,
                                    f"stack_set_{stack}": after}), flush=True)  # fmt: skip
        mem(f"trim+cublas+stack{stack}")
        if args.ckpt_each:  # the same engine, the same machine: an A/B of the stack's size
            at = cycle({"model": args.model.name, "mode": mode, "stack": after.get("stack")})
            print("CKPT_AT", json.dumps(at), flush=True)

    ck = {"model": args.model.name, "mode": mode, "trim": trim}
    if not (args.ckpt_each and args.stack_bytes):
        cycle(ck)
    try:
        if args.stack_back and args.stack_bytes and isinstance(stack_before, int):
            back = llm.collective_rpc(_ctx_limits, args=(min(stack_before, 1024),))[0]
            ck["stack_back"] = back.get("stack")
        eng.wake()
        again = eng.generate(prompt, 16)
        ck["identical"] = again == cold
    except Exception as e:  # noqa: BLE001 - the line says what failed
        ck["after_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print("CKPT", json.dumps(ck), flush=True)
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
