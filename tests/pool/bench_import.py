"""Import and verify throughput of the pool on tmpfs.

Manual: ``python tests/pool/bench_import.py [GIB]`` (writes a random checkpoint to /dev/shm).
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from pathlib import Path

from spswap.pool.store import Pool

TENSOR_BYTES = 64 << 20


def main() -> None:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    n = max(int(gib * (1 << 30) // TENSOR_BYTES), 1)
    src = Path("/dev/shm/spswap-bench-model.safetensors")
    header, off = {}, 0
    for i in range(n):
        header[f"w{i}"] = {"dtype": "F32", "shape": [TENSOR_BYTES // 4],
                           "data_offsets": [off, off + TENSOR_BYTES]}  # fmt: skip
        off += TENSOR_BYTES
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    block = os.urandom(TENSOR_BYTES)
    with open(src, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for i in range(n):
            f.write(block[i:] + block[:i])
    pool = Pool(Path("/dev/shm/spswap-bench-pool"))
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            m = pool.import_checkpoint(src)
            t1 = time.perf_counter()
            pool.verify(m.digest)
            t2 = time.perf_counter()
            size = m.tensor_bytes
            print(f"import {size / (t1 - t0) / 1e9:.2f} GB/s, verify {size / (t2 - t1) / 1e9:.2f} "
                  f"GB/s ({size / 1e9:.1f} GB, {os.cpu_count()} CPUs)", flush=True)  # fmt: skip
            pool.remove(m.digest)
    finally:
        src.unlink()


if __name__ == "__main__":
    main()
