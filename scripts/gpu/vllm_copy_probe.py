#!/usr/bin/env python3
"""Why does the pool -> weights copy run below the pinned limit inside vLLM? Starts a real
vLLM engine on one model, exports and attaches its weights, and asks the worker's
spswap_copy_probe. GPU machine, with the vLLM kit on PYTHONPATH:

    python3 scripts/gpu/vllm_copy_probe.py /tmp/spswap-models/qwen2-0.5b [--first]

--first: also time each way of writing the weights as the first write after a fresh
level-2 sleep + weights wake (with and without a pause first, through new or kept staging
buffers), then a staged copy right after it: which new memory makes the copy slow?
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from spswap.engines.vllm_engine import VllmEngine, rank_result
from spswap.pool.store import Pool


def first_touch(eng: VllmEngine) -> None:
    """Each variant as the first write after a fresh level-2 sleep and weights wake."""
    llm = eng.llm
    llm.collective_rpc("spswap_keep_staging")
    for variant, wait_s in [("staged", 0.0), ("staged-kept", 0.0), ("direct", 0.0),
                            ("direct-touched", 0.0), ("staged-kept", 0.5), ("staged", 0.0),
                            ("memset", 0.0), ("staged-kept", 0.0)]:  # fmt: skip
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        res = rank_result(llm.collective_rpc("spswap_first_copy", args=(variant, wait_s)),
                          "spswap_first_copy", 1)  # fmt: skip
        second = rank_result(llm.collective_rpc("spswap_first_copy", args=("staged", 0.0)),
                             "spswap_first_copy", 1)  # fmt: skip
        print("FIRST", json.dumps({**res, "then_staged_gb_per_s": second["gb_per_s"]}),
              flush=True)  # fmt: skip
        llm.wake_up(tags=["kv_cache"])


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
        first_touch(eng)
    eng.close()


if __name__ == "__main__":
    main()
