#!/usr/bin/env python3
"""Does a CUDA restore pay again for host memory the process had registered (pinned), and
do huge tmpfs pages make that cheaper? GPU machine, root, from the project root:

    python3 scripts/gpu/register_probe.py --sizes-gib 1 6 --dirs /dev/shm/x /mnt/huge

Why: a vLLM engine served by spswap keeps its pool entry mapped and registered with CUDA
(``cudaHostRegister``, ~0.12 s/GiB). A 3B's CUDA restore took 1.09 s after a CRIU
restore against 0.44 s for a 0.5B (0.67 / 0.32 s kept): as if the registered pool entry
(6.3 / 1.2 GiB) were pinned again. For each directory (a tmpfs; mount one with
``-o huge=always`` to compare huge pages) and size, a child process maps a file of that
size, registers it (or not: ``none``), and holds a small CUDA allocation; this process
CUDA-locks, checkpoints, restores and unlocks it, timed. ``dropped``: between checkpoint
and restore the child drops its page table entries of the mapping (``MADV_DONTNEED``),
as a CRIU restore leaves a file mapping (mapped, not faulted in). Then the child copies
from the mapping to the GPU (the registration still works) and exits. Prints one
``REG`` JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

GiB = 1 << 30

CHILD = r"""
import mmap, os, sys, time, json
import torch
from spswap.transfer import cuda_host
path, mode = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDONLY)
size = os.fstat(fd).st_size
m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
base = torch.frombuffer(m, dtype=torch.uint8)
t = time.perf_counter()
reg = cuda_host.register(base.data_ptr(), size) if mode != "none" else None
register_s = time.perf_counter() - t
dev = torch.ones(1 << 20, device="cuda")
torch.cuda.synchronize()
print("READY", json.dumps({"register_s": register_s}), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "DROP":
        m.madvise(mmap.MADV_DONTNEED)
        print("DROPPED", flush=True)
    elif cmd == "CHECK":
        t = time.perf_counter()
        out = base[: 256 << 20].to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        print("CHECKED", json.dumps({"copy_256mib_s": time.perf_counter() - t,
                                     "ok": bool(out[:16].sum().item() == 16 * 7)}), flush=True)
        break
"""


def _shmem_huge_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("ShmemHugePages:"):
            return int(line.split()[1])
    return -1


def _make_file(path: Path, size_bytes: int) -> dict[str, int]:
    before = _shmem_huge_kib()
    with open(path, "wb") as f:  # written, as the pool's files are (7s: the child checks)
        chunk = b"\x07" * (64 << 20)
        for _ in range(size_bytes // len(chunk)):
            f.write(chunk)
    return {"shmem_huge_kib_added": _shmem_huge_kib() - before}


def _case(path: Path, mode: str) -> dict[str, object]:
    from spswap.checkpoint import cuda_ckpt

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), mode], text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    out: dict[str, object] = {"mode": mode}
    try:
        head, _, body = child.stdout.readline().partition(" ")
        if head != "READY":
            return {**out, "error": f"child said {head!r}"}
        out.update(json.loads(body))
        t = time.perf_counter()
        cuda_ckpt.lock(child.pid)
        cuda_ckpt.checkpoint(child.pid)
        out["checkpoint_s"] = time.perf_counter() - t
        if mode == "dropped":
            child.stdin.write("DROP\n")
            child.stdin.flush()
            out["dropped"] = child.stdout.readline().strip() == "DROPPED"
        t = time.perf_counter()
        cuda_ckpt.restore(child.pid)
        out["restore_s"] = time.perf_counter() - t
        cuda_ckpt.unlock(child.pid)
        child.stdin.write("CHECK\n")
        child.stdin.flush()
        head, _, body = child.stdout.readline().partition(" ")
        out.update(json.loads(body) if head == "CHECKED" else {"error": head})
    except Exception as e:  # noqa: BLE001 - a probe reports what failed
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        child.kill()
        child.wait()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-gib", type=int, nargs="+", default=[1, 6])
    ap.add_argument("--dirs", type=Path, nargs="+", required=True)
    ap.add_argument("--modes", nargs="+", default=["none", "kept", "dropped"])
    args = ap.parse_args()
    for d in args.dirs:
        d.mkdir(parents=True, exist_ok=True)
        for size_gib in args.sizes_gib:
            path = d / f"reg-{size_gib}g.bin"
            made = _make_file(path, size_gib * GiB)
            for mode in args.modes:
                res = {"dir": str(d), "size_gib": size_gib, **made, **_case(path, mode)}
                print("REG", json.dumps(res), flush=True)
            path.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
