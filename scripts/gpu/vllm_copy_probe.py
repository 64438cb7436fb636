#!/usr/bin/env python3
"""Why does the pool -> weights copy run below the pinned limit inside vLLM? Starts a real
vLLM engine on one model, exports and attaches its weights, and asks the worker's
spswap_copy_probe. GPU machine, with the vLLM kit on PYTHONPATH:

    python3 scripts/gpu/vllm_copy_probe.py /tmp/spswap-models/qwen2-0.5b [--first]

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

from spswap.engines.vllm_engine import VllmEngine, rank_result
from spswap.pool.store import Pool


def first_touch(eng: VllmEngine, pool: Pool) -> None:
    """Each variant as the first write after a fresh level-2 sleep and weights wake."""
    llm = eng.llm
    llm.collective_rpc("spswap_keep_staging")
    for variant, wait_s in [("pull", 0.0), ("staged", 0.0), ("pull0.7", 0.0), ("pull0.5", 0.0),
                            ("pull0.3", 0.0), ("direct", 0.0), ("pull0.7", 0.5)]:  # fmt: skip
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
    eng = VllmEngine(model)
    print(json.dumps(eng.start(pool, "probe"), default=str), flush=True)
    res = rank_result(eng.llm.collective_rpc("spswap_copy_probe"), "spswap_copy_probe", 1)
    print("PROBE", json.dumps(res), flush=True)
    eng.sleep()
    eng.wake()
    res = rank_result(eng.llm.collective_rpc("spswap_copy_probe"), "spswap_copy_probe", 1)
    print("PROBE-after-cycle", json.dumps(res), flush=True)
    if "--first" in sys.argv:
        first_touch(eng, pool)
    eng.close()


if __name__ == "__main__":
    main()
