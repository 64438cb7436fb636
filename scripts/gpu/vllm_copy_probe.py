#!/usr/bin/env python3
"""Why does the pool -> weights copy run below the pinned limit inside vLLM? Starts a real
vLLM engine on one model, exports and attaches its weights, and asks the worker's
spswap_copy_probe. GPU machine, with the vLLM kit on PYTHONPATH:

    python3 scripts/gpu/vllm_copy_probe.py /tmp/spswap-models/qwen2-0.5b [--first]

--kv-gib N: a KV cache of N GiB (default: what gpu_memory_utilization=0.4 leaves);
--first-only: only the first-copy variants (with --kv-gib: those for a small KV cache).
--variants V,V@WAIT_S,...: these first-copy variants instead (e.g. "staged,pull0.2,pull"):
each as the first write after its own sleep, @WAIT_S after a pause of that many seconds.
--first: also time each way of writing the weights as the first write after a fresh
level-2 sleep + weights wake (with and without a pause first, through new or kept staging
buffers, or pulled by the GPU's cores), then a staged copy right after it: which new
memory makes the copy slow? Ends with a byte-for-byte check of the weights.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from spswap.engines.vllm_engine import VllmEngine, VllmSettings, rank_result
from spswap.pool.store import Pool

FIRST_VARIANTS = [("pull", 0.0), ("staged", 0.0), ("pull0.7", 0.0), ("pull0.5", 0.0),
                  ("pull0.3", 0.0), ("direct", 0.0), ("pull0.7", 0.5)]  # fmt: skip
# With a small KV cache the driver has little to clear after the sleep (sleep_probe.py):
# which way of copying is fastest then?
SMALL_KV_VARIANTS = [("staged", 0.0), ("direct", 0.0), ("staged-kept", 0.0), ("pull", 0.0),
                     ("staged", 0.0), ("direct", 0.0)]  # fmt: skip


def first_touch(eng: VllmEngine, pool: Pool, variants: list[tuple[str, float]]) -> None:
    """Each variant as the first write after a fresh level-2 sleep and weights wake."""
    llm = eng.llm
    llm.collective_rpc("spswap_keep_staging")
    for variant, wait_s in variants:
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        res = rank_result(llm.collective_rpc("spswap_first_copy", args=(variant, wait_s)),
                          "spswap_first_copy", 1)  # fmt: skip
        second = rank_result(llm.collective_rpc("spswap_first_copy", args=("staged", 0.0)),
                             "spswap_first_copy", 1)  # fmt: skip
        print("FIRST", json.dumps({**res, "then_staged_gb_per_s": second["gb_per_s"]}),
              flush=True)  # fmt: skip
        llm.wake_up(tags=["kv_cache"])
    args = (str(pool.pool_dir), eng._attached["digest"])  # every byte as in the pool?
    print("VERIFY", json.dumps(rank_result(llm.collective_rpc("spswap_verify", args=args),
                                           "spswap_verify", 1)), flush=True)  # fmt: skip


def main() -> None:
    model = Path(sys.argv[1])
    pool = Pool(Path(tempfile.mkdtemp(dir="/dev/shm")) / "pool")
    kv_gib = float(sys.argv[sys.argv.index("--kv-gib") + 1]) if "--kv-gib" in sys.argv else 0
    eng = VllmEngine(model, VllmSettings(kv_cache_memory_bytes=int(kv_gib * (1 << 30)) or None))
    print(json.dumps(eng.start(pool, "probe"), default=str), flush=True)
    size = int(eng.weights_info()["size_bytes"])
    print("PINNED", json.dumps(eng.pinned_copy_limit(size)), flush=True)
    if "--first-only" not in sys.argv:
        res = rank_result(eng.llm.collective_rpc("spswap_copy_probe"), "spswap_copy_probe", 1)
        print("PROBE", json.dumps(res), flush=True)
        eng.sleep()
        eng.wake()
        res = rank_result(eng.llm.collective_rpc("spswap_copy_probe"), "spswap_copy_probe", 1)
        print("PROBE-after-cycle", json.dumps(res), flush=True)
    if "--first" in sys.argv or "--first-only" in sys.argv:
        variants = SMALL_KV_VARIANTS if kv_gib else FIRST_VARIANTS
        if "--variants" in sys.argv:
            given = sys.argv[sys.argv.index("--variants") + 1].split(",")
            variants = [(v.split("@")[0], float(v.split("@")[1]) if "@" in v else 0.0)
                        for v in given]  # fmt: skip
        first_touch(eng, pool, variants)
    eng.close()


if __name__ == "__main__":
    main()
